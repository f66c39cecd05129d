"""A fake node agent for the ``pytorch.distributed`` protocol: a thread that answers one handshake with files.

It stands for the agent's side only as far as the client needs (the real one is ``replicator``): it consumes
``replicator.yaml``, then writes ``replicator.prerestore`` and a restore marker (a zero-byte file for step 0, else
a relative symlink to a staged directory), or ``replicator.failed``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import yaml


class FakeTorchAgent:
    """Answers one handshake in ``local_dir``.

    Args:
        local_dir: the client dir.
        job: the job name of the marker.
        node: the node rank of the marker.
        restore_step: 0 for fresh, else the step whose directory ``staged`` is linked by the marker.
        staged: the directory name (inside ``local_dir``) the marker points to.
        failed: if set, written to ``replicator.failed`` instead of answering.
        errors: if set, written to ``replicator.errors`` before the answer.
        consume_delay_s: seconds to wait before consuming the yaml.
    """

    def __init__(
        self,
        local_dir: Path,
        job: str,
        node: int = 0,
        restore_step: int = 0,
        staged: str | None = None,
        failed: str | None = None,
        errors: str | None = None,
        consume_delay_s: float = 0.05,
    ) -> None:
        self.local_dir, self.job, self.node = Path(local_dir), job, node
        self.restore_step, self.staged = restore_step, staged
        self.failed, self.errors, self.consume_delay_s = failed, errors, consume_delay_s
        self.config: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeTorchAgent:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def marker_name(self) -> str:
        return f"{self.job}-s{self.restore_step}-n{self.node}-w0.restore"

    def _write(self, name: str, text: str) -> None:
        """As the agent writes its files: whole (tmp + rename). A plain write let the client poll an empty
        ``replicator.failed`` between its creation and its text (a flaky failure under load)."""
        tmp = self.local_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.local_dir / name)

    def _run(self) -> None:
        yaml_path = self.local_dir / "replicator.yaml"
        while not self._stop.is_set():
            if yaml_path.exists():
                time.sleep(self.consume_delay_s)
                self.config = yaml.safe_load(yaml_path.read_text())
                if self.errors is not None:
                    self._write("replicator.errors", self.errors)
                if self.failed is not None:
                    self._write("replicator.failed", self.failed)
                    yaml_path.unlink()
                    return
                yaml_path.unlink()
                prerestore = "{}\n" if self.restore_step == 0 else f"restore-step: {self.restore_step}\n"
                self._write("replicator.prerestore", prerestore)
                marker = self.local_dir / self.marker_name()
                if self.restore_step == 0:
                    marker.touch()
                else:
                    os.symlink(self.staged, marker)
                return
            time.sleep(0.01)


def stage_step(local_dir: Path, step: int, name: str | None = None) -> str:
    """Copies the committed ``<local>/<step>`` to ``<local>/<name>`` (what a restore stages) and returns the name."""
    name = name or f".staged-{step}"
    shutil.copytree(Path(local_dir) / str(step), Path(local_dir) / name)
    return name
