"""The PyTorch client (mtc_torch) in real torchrun jobs against a fake agent: commits, a SIGKILL, an exact resume.

The torch jobs run under the PyTorch venv (``make torch-setup``: ``.venv-torch``, or ``$TORCH_VENV``); the tests that
need it are skipped, with the reason, when it is missing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.helpers.polling import wait_until
from tests.helpers.torch_agent import FakeTorchAgent, stage_step

REPO = Path(__file__).resolve().parents[2]
TORCH_VENV = Path(os.environ.get("TORCH_VENV", REPO / ".venv-torch"))
TORCH_PYTHON = TORCH_VENV / "bin" / "python"
needs_torch = pytest.mark.skipif(
    not TORCH_PYTHON.exists(), reason=f"no PyTorch venv at {TORCH_VENV}: run `make torch-setup` (or set TORCH_VENV)"
)
JOB = "tj"


def start_job(local: Path, dump: Path, steps: int, *extra: str) -> subprocess.Popen:
    """A 1-node x 2-local-rank torchrun job of examples/train_torch.py in its own process group; stderr goes to
    ``<dump>.log``."""
    cmd = [
        str(TORCH_PYTHON),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(REPO / "examples" / "train_torch.py"),
        "--local-dir",
        str(local),
        "--job-name",
        JOB,
        "--steps",
        str(steps),
        "--save-interval-steps",
        "4",
        "--dump-dir",
        str(dump),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("NODE_RANK", None)  # torchrun's GROUP_RANK is the fallback
    with open(f"{dump}.log", "a") as log, open(f"{dump}.out", "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=log, text=True, env=env, start_new_session=True)


def finish(job: subprocess.Popen, dump: Path) -> list[dict]:
    """Waits for the job, asserts it succeeded, and returns its JSON events."""
    assert job.wait(timeout=240) == 0, Path(f"{dump}.log").read_text()[-3000:]
    return events(Path(f"{dump}.out").read_text())


def sigkill_all(job: subprocess.Popen) -> None:
    """SIGKILLs torchrun and every worker (torchrun starts its workers in sessions of their own)."""
    workers = psutil.Process(job.pid).children(recursive=True)
    os.killpg(job.pid, signal.SIGKILL)
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    job.wait(timeout=30)
    psutil.wait_procs(workers, timeout=30)


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def losses(evs: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in evs if e["event"] == "step"}


def committed_steps(local: Path) -> list[int]:
    return sorted(
        int(p.name)
        for p in local.iterdir()
        if p.name.isdigit() and all((p / f"rank-{r}-of-2" / ".metadata").is_file() for r in range(2))
    )


def assert_same_npz(left: Path, right: Path) -> None:
    with np.load(left) as a, np.load(right) as b:
        assert sorted(a.files) == sorted(b.files) and len(a.files) > 6
        for key in a.files:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def fresh_local(tmp_path: Path, name: str) -> Path:
    local = tmp_path / name
    local.mkdir()
    return local


@needs_torch
def test_sigkilled_torchrun_job_resumes_from_staged_step_bit_identically(tmp_path):
    # The reference: never interrupted, synchronous saves.
    ref_local = fresh_local(tmp_path, "ref")
    with FakeTorchAgent(ref_local, JOB):
        ref_events = finish(start_job(ref_local, tmp_path / "ref-dump", 16), tmp_path / "ref-dump")
    assert [e["step"] for e in ref_events if e["event"] == "saved"] == [4, 8, 12, 16]
    assert committed_steps(ref_local) == [4, 8, 12, 16]

    # The job under test trains until killed; its steps are committed by renames of <S>.tmp.
    local = fresh_local(tmp_path, "local")
    dump = tmp_path / "dump"
    with FakeTorchAgent(local, JOB) as agent:
        job = start_job(local, dump, 10**9, "--step-sleep", "0.2")
        try:
            wait_until(lambda: 8 in committed_steps(local), 120, "step 8 committed")
        finally:
            sigkill_all(job)
    assert agent.config["workers-per-node"] == 2 and agent.config["node-rank"] == 0
    newest = committed_steps(local)[-1]
    assert newest in (8, 12), committed_steps(local)
    assert not (local / f"{newest}.tmp").exists()
    # Deterministic files: the same step of two runs in different directories is byte-identical.
    for rank in range(2):
        names = sorted(os.listdir(local / "8" / f"rank-{rank}-of-2"))
        assert ".metadata" in names and "__0_0.distcp" in names
        assert names == sorted(os.listdir(ref_local / "8" / f"rank-{rank}-of-2"))
        for name in names:
            assert (local / "8" / f"rank-{rank}-of-2" / name).read_bytes() == (
                ref_local / "8" / f"rank-{rank}-of-2" / name
            ).read_bytes()

    # What the agent does at a restart: clear the previous pod's files, stage the newest step, link a marker.
    for name in os.listdir(local):
        if (
            name.endswith((".restore", ".prerestore"))
            or (name.isdigit() and int(name) > newest)
            or name.endswith(".tmp")
        ):
            path = local / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    staged = stage_step(local, newest)
    with FakeTorchAgent(local, JOB, restore_step=newest, staged=staged):
        evs = finish(start_job(local, dump, 16, "--async-save"), dump)
    assert [e for e in evs if e["event"] == "restored"] == [{"event": "restored", "step": newest, "node": 0}]
    assert os.readlink(local / f"step={newest}") == staged
    after = losses(evs)
    assert sorted(after) == list(range(newest + 1, 17))
    assert after == {s: loss for s, loss in losses(ref_events).items() if s > newest}
    assert [e["step"] for e in evs if e["event"] == "saved"] == [s for s in (12, 16) if s > newest]
    assert 16 in committed_steps(local)
    for rank in range(2):
        assert_same_npz(dump / f"rank{rank}-step16.npz", tmp_path / "ref-dump" / f"rank{rank}-step16.npz")
        assert_same_npz(dump / f"rank{rank}-step{newest}.npz", tmp_path / "ref-dump" / f"rank{rank}-step{newest}.npz")


_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"grpc", "aiohttp", "msgspec", "boto3", "replicator", "prefetch", "csi_driver"}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def run_blocked(python: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-c", _BLOCKER + code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_protocol_imports_without_the_agent_dependencies_or_torch():
    code = "import mtc_torch, mtc_torch.protocol; print(mtc_torch.ReplicatorFailed.__name__, 'torch' in sys.modules)"
    result = run_blocked(Path(sys.executable), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ReplicatorFailed", "False"]


@needs_torch
def test_manager_imports_without_the_agent_dependencies():
    code = "from mtc_torch import CheckpointManager; import mtc_torch.storage; print(CheckpointManager.__name__)"
    result = run_blocked(TORCH_PYTHON, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "CheckpointManager"
