"""A stand-in for a NeMo job that checkpoints through Google's Resiliency library: its files, in its order.

The library (``AI-Hypercomputer/resiliency``) is not on PyPI and needs NeMo, Megatron and GPUs. This client
speaks the same files with plain bytes, as ``high_scale_ckpt_utils`` and the library's ``ModelCheckpoint``
(``enable_high_scale_ckpt``, async save, ``filename="{step}"``) do; one process per node stands for its
local ranks, and imports nothing of ours (a pod has none of it). Run as
``python tests/helpers/nemo_client.py --local-dir /local --job-name J --node-rank i --nodes N``.

Start-up:
  ``replicator.yaml`` written in place, ``open`` then ``yaml.dump`` (``--yaml-stall`` seconds between them);
  NeMo's ``ModelCheckpoint.setup`` removes its unfinished saves; then ``block_and_proces_restore_dir``:
  the wait for the yaml's deletion, ``replicator.errors`` / ``.failed``, ``replicator.prerestore``, a
  ``*.restore`` marker renamed to ``step=<step>`` (step 0: left alone); the newest ``step=<n>`` directory
  without an ``-unfinished`` mark is loaded, and the unfinished saves are removed again.

A save of global step G:
  ``step=G-unfinished``, ``step=G/``; then, in the background (async save), per local rank
  ``step=G/<global rank>/__<global rank>_0.distcp`` and its ``.metadata``, then ``common.pt`` and
  ``metadata.json``. Finalized at a later step: the mark deleted, ``replicator.errors`` read,
  ``step=G`` renamed to ``<G-1>`` (the commit; ``--finalize-pause`` seconds after the mark went).

Each global rank's state is bytes that every step derives from the last (a hash chain), so a resumed
run repeats the killed run's losses only if it loaded the exact bytes. ``--dump-dir`` gets
``rank<r>-step<G>.bin`` at every save and after a restore. Events are JSON lines on stdout:
``restored`` (``step``: the adopted step or null; ``global_step``: the one loaded, or null), ``step``
(node 0's only, as a trainer's rank 0 logs: ``step``, the global step, and ``loss`` of its ranks'
states), ``saved`` (``step``: the committed G-1; ``global_step``: G), ``replicator_error`` (what
``replicator.errors`` held), ``failed``, ``done``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import yaml

CONFIG, ERRORS, FAILED, PRERESTORE = (
    "replicator.yaml",
    "replicator.errors",
    "replicator.failed",
    "replicator.prerestore",
)
UNFINISHED = "-unfinished"
_SAVE = re.compile(r"^step=([0-9]+)$")
_MARKER_STEP = re.compile(r"-s([0-9]+)-n[0-9]+-w[0-9]+")


class ReplicatorFailed(RuntimeError):
    """The agent refused the job (``replicator.failed``); the message is the file's."""


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def wait_for(condition, timeout: float, what: str):
    """Polls ``condition`` until it returns something true, and returns that, as the library does (its
    loops sleep 1 s; 0.05 s here keeps tests short)."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout} s")
        time.sleep(0.05)
    return found


def write_config(local: Path, config: dict, stall: float = 0.0, timeout: float = 300.0) -> None:
    """``init_high_scale_ckpt``: waits for an earlier ``replicator.yaml`` to go, then writes it in place."""
    wait_for(lambda: not (local / CONFIG).exists(), timeout, f"{CONFIG} of an earlier start gone")
    with open(local / CONFIG, "w") as f:  # the file exists, empty, from here on
        time.sleep(stall)
        yaml.dump(config, f, default_flow_style=False, sort_keys=False)


def read_reports(local: Path) -> None:
    """``handle_replicator_fail_situation``: logs and deletes ``replicator.errors``; raises on ``.failed``."""
    if (local / ERRORS).exists():
        emit(event="replicator_error", message=(local / ERRORS).read_text())
        (local / ERRORS).unlink()
    if (local / FAILED).exists():
        message = (local / FAILED).read_text()
        (local / FAILED).unlink()
        raise ReplicatorFailed(message)


def take_restore(local: Path, timeout: float = 300.0) -> int | None:
    """``block_and_proces_restore_dir``: the step the agent staged, its marker renamed to ``step=<step>``;
    None for a fresh start.

    Raises:
      ReplicatorFailed: the agent refused the job.
      TimeoutError: a file the library waits for did not come.
    """
    wait_for(lambda: not (local / CONFIG).exists(), timeout, f"{CONFIG} consumed")
    read_reports(local)
    wait_for(lambda: (local / PRERESTORE).exists(), timeout, PRERESTORE)
    announced = int((yaml.safe_load((local / PRERESTORE).read_text()) or {}).get("restore-step", 0))
    marker = wait_for(lambda: next(local.glob("*.restore"), None), timeout, "a restore marker")
    found = _MARKER_STEP.search(marker.name)
    step = int(found[1]) if found else 0
    if step != announced:
        raise RuntimeError(f"the marker {marker.name} is not the announced step {announced}")
    if step == 0:
        return None
    os.rename(marker, local / f"step={step}")
    return step


def remove_unfinished(local: Path) -> None:
    """``_remove_unfinished_checkpoints``: every directory beside an ``-unfinished`` mark, then the marks
    (paths resolved, as the library does: a ``step=<n>`` link is matched by its target's name)."""
    marks = [path.resolve() for path in local.glob(f"*{UNFINISHED}") if path.is_file()]
    for path in {path.resolve() for path in local.iterdir() if path.is_dir()}:
        if Path(f"{path}{UNFINISHED}") in marks:
            shutil.rmtree(path)
    for mark in marks:
        mark.unlink()


def newest_save(local: Path) -> Path | None:
    """``find_latest_checkpoint_path``: the newest ``step=<n>`` directory (links followed) with no mark beside."""
    found = [
        (int(m[1]), path)
        for path in local.iterdir()
        if (m := _SAVE.match(path.name)) and path.is_dir() and not Path(f"{path}{UNFINISHED}").exists()
    ]
    return max(found)[1] if found else None


def advance(state: bytes, step: int) -> bytes:
    """The next state: ``len(state)`` bytes hashed from all of the last state and the step."""
    seed = hashlib.sha256(state + step.to_bytes(8, "little")).digest()
    return b"".join(hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(len(state) // 32))


def loss(states: dict[int, bytes]) -> float:
    return int.from_bytes(hashlib.sha256(b"".join(states[r] for r in sorted(states))).digest()[:6], "little") / 2**48


def save_files(save: Path, global_step: int, states: dict[int, bytes]) -> None:
    """What the ranks write into ``step=G/`` (the background part of an async save)."""
    for rank, state in states.items():
        (save / str(rank)).mkdir()
        (save / str(rank) / f"__{rank}_0.distcp").write_bytes(state)
        (save / str(rank) / ".metadata").write_text(
            json.dumps({"bytes": len(state), "sha256": hashlib.sha256(state).hexdigest()})
        )
    (save / "common.pt").write_text(json.dumps({"global_step": global_step}))
    (save / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))


def load(save: Path, ranks: list[int]) -> tuple[int, dict[int, bytes]]:
    """The global step and the ranks' states of a save, each checked against its ``.metadata``."""
    states = {}
    for rank in ranks:
        state = (save / str(rank) / f"__{rank}_0.distcp").read_bytes()
        if hashlib.sha256(state).hexdigest() != json.loads((save / str(rank) / ".metadata").read_text())["sha256"]:
            raise RuntimeError(f"{save}/{rank} does not match its .metadata")
        states[rank] = state
    return json.loads((save / "common.pt").read_text())["global_step"], states


def dump(dump_dir: str | None, global_step: int, states: dict[int, bytes]) -> None:
    for rank, state in states.items() if dump_dir else ():
        os.makedirs(dump_dir, exist_ok=True)
        Path(dump_dir, f"rank{rank}-step{global_step}.bin").write_bytes(state)


class AsyncSave:
    """One save of global step G in flight: the ranks' files in a thread, then ``finalize``."""

    def __init__(self, local: Path, global_step: int, states: dict[int, bytes]):
        self.local, self.global_step = local, global_step
        self.save = local / f"step={global_step}"
        Path(f"{self.save}{UNFINISHED}").touch()
        self.save.mkdir()
        self._thread = threading.Thread(target=save_files, args=(self.save, global_step, dict(states)))
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def finalize(self, pause: float) -> int:
        """The library's finalize callback: the mark deleted, reports read, ``step=G`` renamed to ``<G-1>``
        (returned)."""
        self._thread.join()
        Path(f"{self.save}{UNFINISHED}").unlink()
        time.sleep(pause)
        read_reports(self.local)
        os.rename(self.save, self.local / str(self.global_step - 1))
        return self.global_step - 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--job-name", required=True)
    parser.add_argument(
        "--node-rank", type=int, default=int(os.environ.get("NODE_RANK", 0)), help="the library reads NODE_RANK"
    )
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("NNODES", 1)), help="the library reads NNODES")
    parser.add_argument("--local-ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-interval-steps", type=int, default=3)
    parser.add_argument("--backup-interval-minutes", type=int, default=30)
    parser.add_argument("--shard-bytes", type=int, default=64 << 10)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--yaml-stall", type=float, default=0.0)
    parser.add_argument("--finalize-pause", type=float, default=0.0)
    parser.add_argument("--dump-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local, node = Path(args.local_dir), args.node_rank
    config = {
        "job-name": args.job_name,
        "framework": "pytorch.distributed",
        "node-rank": node,
        "nodes": args.nodes,
        "peers-per-node": 1,
        "backup-interval-minutes": args.backup_interval_minutes,
    }
    write_config(local, config, args.yaml_stall)
    remove_unfinished(local)
    try:
        adopted = take_restore(local)
    except ReplicatorFailed as err:
        emit(event="failed", message=str(err), node=node)
        return 1
    ranks = [node * args.local_ranks + r for r in range(args.local_ranks)]
    save = newest_save(local)
    if save is None:
        global_step, states = 0, {r: advance(bytes(args.shard_bytes - 8) + r.to_bytes(8, "little"), 0) for r in ranks}
    else:
        global_step, states = load(save, ranks)
        dump(args.dump_dir, global_step, states)
    remove_unfinished(local)
    emit(event="restored", step=adopted, global_step=global_step if save else None, node=node)
    pending: AsyncSave | None = None

    def finalize() -> None:
        emit(event="saved", step=pending.finalize(args.finalize_pause), global_step=pending.global_step, node=node)

    for global_step in range(global_step + 1, args.steps + 1):  # noqa: B020  # it starts after the restored step
        if pending is not None and pending.done():
            finalize()
            pending = None
        states = {r: advance(state, global_step) for r, state in states.items()}
        if node == 0:
            emit(event="step", step=global_step, loss=loss(states), time=time.time())
        if global_step % args.save_interval_steps == 0:
            if pending is not None:  # one async save at a time: the earlier one is finalized first
                finalize()
            dump(args.dump_dir, global_step, states)
            pending = AsyncSave(local, global_step, states)
        time.sleep(args.step_sleep)
    if pending is not None:
        finalize()
    emit(event="done", node=node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
