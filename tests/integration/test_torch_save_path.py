"""mtc_torch's save and restore data path on CPU tensors, in the PyTorch venv: the staging buffers are kept across
saves, a state changed after the allowed point leaves the checkpoint as it was, the parallel reader is bit-identical
and adds no copy of the state, data-parallel replicas write byte-identical files, and steps written by torch's own
``FileSystemWriter`` (as mtc_torch wrote them before) still restore.

Each check runs as a script under the venv's Python (the test process has no torch) and prints one JSON line. The
GPU half of the path (pinned buffers, side streams) is measured by ``tests/bench/torch_gpu.py`` on a GPU machine.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.torch_venv import TORCH_PYTHON, needs_torch_venv

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs_torch_venv

_PRELUDE = """
import json, os, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from mtc_torch import CheckpointManager
from mtc_torch.reader import StepReader
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
ENV = {"NODE_RANK": "0", "NNODES": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}

def manager(local, **kwargs):
    os.makedirs(local, exist_ok=True)
    return CheckpointManager(local, job_name="t", backup_interval_steps=100, env=ENV, **kwargs)

def state(seed, mib=8):
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(mib << 16, generator=g).to(torch.bfloat16) for i in range(4)},
            "optim": {"exp_avg": torch.randn(mib << 18, generator=g), "step": torch.tensor(seed)},
            "extra": {"epoch": seed, "note": "kept", "history": [1.5, torch.arange(3)]}}

def zeros(like):
    if isinstance(like, dict):
        return {k: zeros(v) for k, v in like.items()}
    if isinstance(like, list):
        return [zeros(v) for v in like]
    return torch.zeros_like(like) if isinstance(like, torch.Tensor) else like

def equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b

def load(step_dir, target, threads=4):
    dcp.load(target, storage_reader=StepReader(os.path.join(step_dir, "rank-0-of-1"), threads=threads), no_dist=True)
    return target
"""


def run(tmp_path: Path, script: str) -> dict:
    result = subprocess.run(
        [str(TORCH_PYTHON), "-c", _PRELUDE + script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_staging_buffers_are_the_same_storage_at_every_save(tmp_path):
    out = run(
        tmp_path,
        """
local = sys.argv[1] + "/local"
m = manager(local)
s = state(1)
pointers = []
for step in (1, 2, 3):
    m.async_save(s, step).result()
    pointers.append(sorted(b.tensor.data_ptr() for b in m._stager._buffers.values()))
    s["optim"]["exp_avg"].add_(1.0)
del s["optim"]["step"]                # a tensor the state no longer holds gives its buffer back
m.async_save(s, 4).result()
kept = len(m._stager._buffers)
host = sum(b.tensor.numel() * b.tensor.element_size() for b in m._stager._buffers.values())
m.close()
print(json.dumps({"same": pointers[0] == pointers[1] == pointers[2], "buffers": len(pointers[0]), "host": host,
                  "kept": kept}))
""",
    )
    assert out["same"] and out["buffers"] == 7
    assert out["kept"] == 6
    assert out["host"] == 4 * (8 << 17) + (8 << 20) + 3 * 8  # bf16 weights, fp32 moments, arange(3)


@pytest.mark.parametrize("mode", ["async_save returns staged", "wait_for_staging before the change", "save"])
def test_a_state_changed_right_after_the_allowed_point_leaves_the_checkpoint_as_it_was(tmp_path, mode):
    out = run(
        tmp_path,
        f"""
mode = {mode!r}
local = sys.argv[1] + "/local"
m = manager(local)
s = state(2)
before = {{k: v.clone() for k, v in s["model"].items()}}, s["optim"]["exp_avg"].clone()
if mode == "save":
    m.save(s, 5)
elif mode == "async_save returns staged":
    future = m.async_save(s, 5)
else:
    future = m.async_save(s, 5, wait_for_staging=False)
    m.wait_for_staging()
for v in s["model"].values():
    v.mul_(-3.0)                       # what an optimizer step does, at once
s["optim"]["exp_avg"].add_(7.0)
s["extra"]["history"][1].add_(5)      # nested containers are copied too
s["extra"]["note"] = "changed"
if mode != "save":
    future.result()
m.close()
target = load(local + "/5", zeros(state(0)))
print(json.dumps({{"model": equal(target["model"], before[0]), "optim": torch.equal(target["optim"]["exp_avg"], before[1]),
                  "history": target["extra"]["history"][1].tolist(), "note": target["extra"]["note"]}}))
""",
    )
    assert out == {"model": True, "optim": True, "history": [0, 1, 2], "note": "kept"}


def test_the_parallel_reader_is_bit_identical_and_reads_into_the_destinations_without_a_copy(tmp_path):
    out = run(
        tmp_path,
        """
import resource
local = sys.argv[1] + "/local"
m = manager(local)
g = torch.Generator().manual_seed(3)
s = {"big": {f"t{i}": torch.randn(32 << 20, generator=g) for i in range(4)},                  # 4 x 128 MiB
     "odd": torch.randn(1001, 7, generator=g).to(torch.float16), "empty": torch.empty(0, 4)}
m.save(s, 1)
m.close()
del m
target = {"big": {k: torch.zeros_like(v) for k, v in s["big"].items()}, "odd": torch.zeros(1001, 7, dtype=torch.float16),
          "empty": torch.empty(0, 4)}
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
peak_before = rss()
addresses = [t.data_ptr() for t in target["big"].values()]
load(local + "/1", target, threads=4)
grown = rss() - peak_before
same_storage = addresses == [t.data_ptr() for t in target["big"].values()]
print(json.dumps({"equal": equal(s, target), "grown": grown, "same_storage": same_storage}))
""",
    )
    assert out["equal"] and out["same_storage"]
    # torch's FileSystemReader holds a loaded copy of each 128 MiB tensor before copying it over.
    assert out["grown"] < 48 << 20, out


def test_a_load_into_other_dtypes_and_strides_converts_like_torch(tmp_path):
    out = run(
        tmp_path,
        """
local = sys.argv[1] + "/local"
m = manager(local)
s = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int32)}
m.save(s, 1)
m.close()
target = {"w": torch.zeros(4, 3).t(), "b": torch.zeros(5, dtype=torch.float64)}
load(local + "/1", target)
print(json.dumps({"w": target["w"].tolist(), "b": target["b"].tolist(), "b_dtype": str(target["b"].dtype)}))
""",
    )
    assert out == {"w": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], "b": [0, 1, 2, 3, 4], "b_dtype": "torch.float64"}


def test_data_parallel_replicas_write_byte_identical_files_whatever_their_threads_and_whether_params_need_grad(
    tmp_path,
):
    out = run(
        tmp_path,
        """
root = sys.argv[1]
params = {k: torch.nn.Parameter(v.float()) for k, v in state(4)["model"].items()}
layouts = []
for name, threads, value in (("a", 1, state(4)), ("b", 5, state(4)), ("c", 3, {**state(4), "model": params})):
    m = manager(f"{root}/{name}", io_threads=threads)
    if name == "c":
        value["model"] = {k: v for k, v in params.items()}
    else:
        value["model"] = {k: v.float() for k, v in value["model"].items()}
    m.save(value, 9)
    m.close()
    rank = f"{root}/{name}/9/rank-0-of-1"
    layouts.append({n: open(f"{rank}/{n}", "rb").read().hex() for n in sorted(os.listdir(rank))})
print(json.dumps({"files": sorted(layouts[0]), "identical": layouts[0] == layouts[1] == layouts[2]}))
""",
    )
    assert out["identical"]
    assert out["files"] == [".metadata", *(f"__0_{k}.distcp" for k in range(8))]


def test_a_step_in_torchs_own_item_format_restores(tmp_path):
    out = run(
        tmp_path,
        """
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta

class EarlierWriter(FileSystemWriter):  # what mtc_torch 0.8 wrote: torch.save items, no save_id or path
    def storage_meta(self):
        return StorageMeta()

step = sys.argv[1] + "/local/3/rank-0-of-1"
s = state(5)
dcp.save(s, storage_writer=EarlierWriter(step), no_dist=True)
print(json.dumps({"equal": equal(s, load(os.path.dirname(step), zeros(state(0))))}))
""",
    )
    assert out == {"equal": True}


def test_an_item_whose_stored_length_disagrees_with_its_shape_is_refused_by_name(tmp_path):
    out = run(
        tmp_path,
        """
import pickle
from mtc_torch.storage import load_metadata
local = sys.argv[1] + "/local"
m = manager(local)
m.save({"w": torch.ones(10), "v": torch.ones(3)}, 1)
m.close()
path = local + "/1/rank-0-of-1/.metadata"
md = load_metadata(path)
for index, info in md.storage_data.items():
    if index.fqn == "w":
        info.length -= 4
open(path, "wb").write(pickle.dumps(md))
try:
    load(local + "/1", {"w": torch.zeros(10), "v": torch.zeros(3)})
    print(json.dumps({"error": None}))
except BaseException as e:  # dcp.load wraps it in a CheckpointException (a BaseException)
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
""",
    )
    assert (
        out["error"] is not None
        and "w is stored as 36 bytes where its shape [10] of torch.float32 makes 40" in out["error"]
    )
