"""A PyTorch restore into another sharding than the saved one: resharded from the node's step, and refused whole,
never silently partial, when the staged step lacks what a rank asks for.

Real torchrun jobs (1 node x 2 local ranks, gloo) save a step through ``mtc_torch.CheckpointManager`` and load it
through ``manager.load`` after the fake agent's handshake (``tests/helpers/torch_agent.py``; the agent's side is
what a restore from the ramdisk, a peer or the backup tier leaves: the step staged in the ramdisk and a marker).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.torch_agent import FakeTorchAgent, stage_step
from tests.helpers.torch_venv import TORCH_PYTHON, needs_torch_venv

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs_torch_venv
JOB = "mesh"

# argv: local dir, "save" | "load", the placement of "w" and of the Stateful's "exp_avg" ("shard" | "replicate").
_SCRIPT = """
import json, os, sys, warnings
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from mtc_torch import CheckpointManager, PartialRestoreError

local, phase, placement = sys.argv[1:4]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
place = {"shard": Shard(0), "replicate": Replicate()}[placement]

class Optimizer(Stateful):
    def __init__(self, exp_avg):
        self.exp_avg, self.loaded = exp_avg, False
    def state_dict(self):
        return {"exp_avg": self.exp_avg}
    def load_state_dict(self, state):
        self.exp_avg, self.loaded = state["exp_avg"], True

def values(seed):
    return torch.arange(64, dtype=torch.float32).reshape(16, 4) * seed

def nan(*shape):
    return torch.full(shape, float("nan"))

fill = {"save": (values(1), values(2), torch.arange(3.0)), "load": (nan(16, 4), nan(16, 4), nan(3))}[phase]
w, exp_avg = (distribute_tensor(t, mesh, [place]) for t in fill[:2])
optimizer = Optimizer(exp_avg)
state = {"w": w, "bias": fill[2], "optim": optimizer}
manager = CheckpointManager(local, job_name="mesh", backup_interval_steps=100)
out = {"rank": dist.get_rank()}
try:
    out["step"] = manager.load(state)
    if phase == "save":
        manager.save(state, 1)
except PartialRestoreError as error:
    out["error"] = str(error)
    out["keys"] = sorted(u.key for u in error.uncovered)
out["optimizer_loaded"] = optimizer.loaded
out["w"] = w.to_local().tolist()
out["w_full"] = w.full_tensor().tolist() if "error" not in out else None
out["exp_avg_full"] = optimizer.exp_avg.full_tensor().tolist() if "error" not in out else None
out["bias"] = state["bias"].tolist()
manager.close()
with open(f"{local}.rank{dist.get_rank()}.json", "w") as f:  # a file each: the ranks share torchrun's stdout
    json.dump(out, f)
dist.destroy_process_group()
# Without finalizing: torch 2.15's gloo worker threads outlive the group (the DTensors' mesh holds it), and one
# dropping its last collective while the interpreter finalizes aborts the process (SIGABRT, "terminate called
# without an active exception"; tests/bench/torch_job.py, exit_without_finalizing).
os._exit(0)
"""


def run(local: Path, phase: str, placement: str) -> list[dict]:
    """One torchrun job of the script; each rank's result, by rank."""
    script = local.parent / f"{local.name}-job.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("NODE_RANK", None)  # torchrun's GROUP_RANK
    result = subprocess.run(
        [str(TORCH_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"]
        + [str(script), str(local), phase, placement],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{local}.rank{rank}.json").read_text()) for rank in range(2)]


def restore(saved: Path, tmp_path: Path, name: str, placement: str, drop: str | None = None) -> list[dict]:
    """Stages step 1 of ``saved`` into a fresh ramdisk (without its rank directory ``drop``) and loads it with
    ``placement``."""
    local = tmp_path / name
    shutil.copytree(saved / "1", local / "1")
    stage = stage_step(local, 1)
    shutil.rmtree(local / "1")
    if drop:
        shutil.rmtree(local / stage / drop)
    with FakeTorchAgent(local, JOB, restore_step=1, staged=stage):
        return run(local, "load", placement)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Step 1 saved with ``w`` and the optimizer's ``exp_avg`` as ``Shard(0)`` over the 2 ranks."""
    local = tmp_path_factory.mktemp("saved")
    with FakeTorchAgent(local, JOB):
        ranks = run(local, "save", "shard")
    assert [r["step"] for r in ranks] == [None, None]
    return local


FULL_W = [[float(4 * r + c) for c in range(4)] for r in range(16)]


def test_a_sharded_step_loads_into_replicated_tensors_from_both_ranks_directories(saved, tmp_path):
    for rank in restore(saved, tmp_path, "replicate", "replicate"):
        assert "error" not in rank, rank
        assert rank["step"] == 1 and rank["optimizer_loaded"]
        assert rank["w"] == FULL_W  # Replicate: each rank's local tensor is the whole
        assert rank["exp_avg_full"] == [[2 * v for v in row] for row in FULL_W]


def test_a_staged_step_missing_a_rank_refuses_a_partial_restore(saved, tmp_path):
    for rank in restore(saved, tmp_path, "missing", "replicate", drop="rank-1-of-2"):
        assert "error" in rank, rank
        assert rank["keys"] == ["optim.exp_avg", "w"]
        assert "'w' wants [offsets [0, 0] sizes [16, 4]]" in rank["error"]
        stored = "[offsets [0, 0] sizes [8, 4]]"
        assert f"the checkpoint stores {stored}: 32 of its 64 elements would not be read" in rank["error"]
        # Nothing of the state changed: the destinations hold their NaNs, the Stateful was not given a state.
        assert all(v != v for row in rank["w"] for v in row)
        assert all(v != v for v in rank["bias"])
        assert rank["optimizer_loaded"] is False


def test_a_same_mesh_load_restores_bit_for_bit_after_a_partial_one_was_refused(saved, tmp_path):
    restore(saved, tmp_path, "refused", "replicate", drop="rank-1-of-2")
    for rank in restore(saved, tmp_path, "same", "shard"):
        assert "error" not in rank, rank
        assert rank["step"] == 1 and rank["optimizer_loaded"]
        assert rank["w_full"] == FULL_W
        assert rank["exp_avg_full"] == [[2 * v for v in row] for row in FULL_W]
        assert rank["bias"] == [0.0, 1.0, 2.0]
