"""A PyTorch step saved by 2 nodes x 2 local ranks, loaded resharded by stock DCP, and exported.

Real torchrun jobs (gloo, CPU) save step 1 through ``mtc_torch.CheckpointManager``; the two nodes are emulated by
the ranks' topology (``env`` of the manager: NODE_RANK = rank // 2, each node its own ramdisk directory and fake
agent, ``tests/helpers/torch_agent.py``). Then:

- ``dcp.load`` with ``mtc_torch.StepReader`` over the multi-node step (``node-<n>-of-2/``) at world sizes 1 and 3;
- ``manager.load`` of a staged multi-node step on 1 node x 3 ranks (what an elastic restore stages), and of each
  node's own step after HSDP -> FSDP at the same world size;
- a step missing a node refuses a partial load;
- ``mtc export`` from a ``file://`` backup store, loaded by stock ``dcp.load`` in a Python where ``mtc_torch`` is
  not importable, at world sizes 1 and 3; a corrupted object is refused.

Every tensor is gathered to full and compared bit for bit with the saved values, in the job.
"""

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.transfers import RankUpload
from replicator.local_tier.step_manifest import build_manifest
from replicator.wire.messages import JobRef
from tests.helpers.torch_agent import FakeTorchAgent, stage_step
from tests.helpers.torch_venv import TORCH_PYTHON, needs_torch_venv

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs_torch_venv
JOB = "reshard"

# The saved values, a function of the key alone; the placements of the mesh kind; the check after a load.
_STATE = """
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

def values():
    return {
        "w": torch.arange(30, dtype=torch.float32).reshape(10, 3) * 1.5,
        "emb": (torch.arange(50, dtype=torch.float32).reshape(10, 5) / 7).to(torch.bfloat16),
        "optim.exp_avg": torch.arange(30, dtype=torch.float64).reshape(10, 3) / 3 + 1,
        "bias": torch.tensor([1.0, -2.0, 3.25]),
    }

class Optimizer(Stateful):
    def __init__(self, exp_avg):
        self.exp_avg, self.loaded = exp_avg, False
    def state_dict(self):
        return {"exp_avg": self.exp_avg}
    def load_state_dict(self, state):
        self.exp_avg, self.loaded = state["exp_avg"], True

def state_of(mesh, placements, fill):
    v = {k: t if fill else torch.full_like(t, float("nan")) for k, t in values().items()}
    dist = {k: distribute_tensor(v[k], mesh, placements) for k in ("w", "emb", "optim.exp_avg")}
    return {"w": dist["w"], "emb": dist["emb"], "optim": Optimizer(dist["optim.exp_avg"]), "bias": v["bias"],
            "extra": {"count": 7 if fill else 0}}

def mismatches(state):
    got = {"w": state["w"].full_tensor(), "emb": state["emb"].full_tensor(),
           "optim.exp_avg": state["optim"].exp_avg.full_tensor(), "bias": state["bias"]}
    bad = [k for k, t in values().items() if not torch.equal(got[k], t)]
    return bad + ([] if state["extra"]["count"] == 7 else ["extra.count"])
"""

# argv: base dir, phase (save | manager | reader), mesh (fsdp | hsdp), nodes, [step dir for reader].
_SCRIPT = (
    _STATE
    + """
import json, os, sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from mtc_torch import CheckpointManager, PartialRestoreError, StepReader

base, kind, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
per_node = world // nodes
node, local_rank = divmod(rank, per_node)
if kind == "hsdp":
    mesh, placements = init_device_mesh("cpu", (nodes, per_node)), [Replicate(), Shard(0)]
else:
    mesh, placements = init_device_mesh("cpu", (world,)), [Shard(0)]

def run(phase, path):
    state = state_of(mesh, placements, phase == "save")
    out = {"rank": rank}
    try:
        if phase in ("reader", "partial"):  # partial: each rank alone, so one refusing stops no other's collective
            try:
                dcp.load(state, storage_reader=StepReader(path, threads=2), no_dist=phase == "partial")
            except CheckpointException as failed:
                raise next(e for e, _ in failed.failures.values() if isinstance(e, PartialRestoreError)) from failed
        else:
            env = {"NODE_RANK": str(node), "NNODES": str(nodes), "LOCAL_RANK": str(local_rank),
                   "LOCAL_WORLD_SIZE": str(per_node)}
            manager = CheckpointManager(f"{base}/node{node}", job_name="reshard", backup_interval_steps=100,
                                        env=env, io_threads=2)
            out["step"] = manager.load(state)
            if phase == "save":
                manager.save(state, 1)
            manager.close()
        out["mismatches"] = None if phase == "partial" else mismatches(state)
    except PartialRestoreError as error:
        out["error"] = str(error)
    out["optimizer_loaded"] = state["optim"].loaded
    out["untouched"] = bool(state["w"].to_local().isnan().all())
    return out

# Each further argument a phase, run in order: save, manager, reader=STEP_DIR or partial=STEP_DIR.
results = {phase.partition("=")[0]: run(*phase.partition("=")[::2]) for phase in sys.argv[4:]}
with open(f"{base}.rank{rank}.json", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
os._exit(0)  # without finalizing, as tests/integration/test_torch_mesh_change.py says why
"""
)


def torchrun(base: Path, world: int, kind: str, nodes: int, *phases: str) -> list[dict]:
    """One torchrun job of the script on ``world`` ranks as ``nodes`` nodes, running ``phases`` in order; each
    rank's results by phase."""
    script = base.parent / f"{base.name}-job.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [str(TORCH_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
        + ["--nproc-per-node", str(world), str(script), str(base), kind, str(nodes), *phases],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{base}.rank{r}.json").read_text()) for r in range(world)]


def save(base: Path, kind: str) -> Path:
    """Step 1 of a 2-node x 2-rank job with ``kind``'s mesh; each node's ramdisk is ``base/node<n>``."""
    for n in range(2):
        (base / f"node{n}").mkdir(parents=True)
    with contextlib.ExitStack() as agents:
        for n in range(2):
            agents.enter_context(FakeTorchAgent(base / f"node{n}", JOB, node=n))
        ranks = torchrun(base, 4, kind, 2, "save")
    assert [r["save"]["mismatches"] for r in ranks] == [[]] * 4
    return base


def multi_node(saved: Path, into: Path, nodes: tuple[int, ...] = (0, 1)) -> Path:
    """``into/node-<n>-of-2/``: a copy of node n's step 1, for each of ``nodes``."""
    for n in nodes:
        shutil.copytree(saved / f"node{n}" / "1", into / f"node-{n}-of-2")
    return into


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("fsdp"), "fsdp")


@pytest.fixture(scope="module")
def three_ranks(fsdp, tmp_path_factory) -> list[dict]:
    """One job of 1 node x 3 ranks over the FSDP step: ``dcp.load`` with ``StepReader`` of the multi-node step,
    then of a step holding node 0 only (each rank alone), then ``manager.load`` of the multi-node step staged."""
    root = tmp_path_factory.mktemp("three")
    step = multi_node(fsdp, root / "step")
    half = multi_node(fsdp, root / "half", nodes=(0,))
    multi_node(fsdp, root / "job" / "node0" / ".staged-1")
    with FakeTorchAgent(root / "job" / "node0", JOB, restore_step=1, staged=".staged-1"):
        return torchrun(root / "job", 3, "fsdp", 1, f"reader={step}", f"partial={half}", "manager")


def test_stock_dcp_load_through_step_reader_reshards_a_two_node_step_to_1_and_3_ranks(fsdp, three_ranks, tmp_path):
    one = torchrun(tmp_path / "one", 1, "fsdp", 1, f"reader={multi_node(fsdp, tmp_path / 'step')}")
    for ranks in (one, three_ranks):
        loads = [(r["reader"].get("error"), r["reader"]["mismatches"], r["reader"]["optimizer_loaded"]) for r in ranks]
        assert loads == [(None, [], True)] * len(ranks)


def test_manager_load_of_a_staged_multi_node_step_on_another_node_count(three_ranks):
    loads = [(r["manager"].get("error"), r["manager"]["step"], r["manager"]["mismatches"]) for r in three_ranks]
    assert loads == [(None, 1, [])] * 3


def test_a_step_missing_a_node_refuses_a_partial_load_and_loads_nothing(three_ranks):
    ranks = [r["partial"] for r in three_ranks]
    for rank in ranks:  # node 0 stored rows 0-5 of 10: ranks 1 (rows 4-7) and 2 (8-9) lack some
        assert ("error" in rank) == (rank["rank"] > 0), rank
        assert rank["untouched"] == (rank["rank"] > 0) and rank["optimizer_loaded"] == (rank["rank"] == 0)
        if rank["rank"] > 0:
            assert "refusing a partial restore, nothing was loaded" in rank["error"]
    assert "'w' wants [offsets [8, 0] sizes [2, 3]] but the checkpoint stores" in ranks[2]["error"]


def test_hsdp_step_restores_into_fsdp_at_the_same_world_size_through_manager_load(tmp_path):
    saved = save(tmp_path / "hsdp", "hsdp")
    base = tmp_path / "fsdp-load"
    with contextlib.ExitStack() as agents:
        for n in range(2):
            local = base / f"node{n}"
            shutil.copytree(saved / f"node{n}" / "1", local / "1")
            agents.enter_context(FakeTorchAgent(local, JOB, node=n, restore_step=1, staged=stage_step(local, 1)))
            shutil.rmtree(local / "1")
        ranks = torchrun(base, 4, "fsdp", 2, "manager")
    assert [(r["manager"].get("error"), r["manager"]["step"], r["manager"]["mismatches"]) for r in ranks] == [
        (None, 1, [])
    ] * 4


# -- mtc export from the backup store, loaded where mtc_torch is not importable --------------------------------------

# A Python started with -I -S and torch's site-packages appended by hand: its .pth files, among them the editable
# install of this project, are never read. torch.multiprocessing's spawn starts the ranks with the same flags.
_STOCK = (
    # Stock torch alone: mtc_torch cannot be imported, here or in the spawned ranks, even from a venv that has the
    # client installed (make client-compat).
    "import sys\nsys.path.append(sys.argv.pop())\nsys.modules['mtc_torch'] = None\n"
    + _STATE
    + """
import json, os, sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

def rank_main(rank, world, export, init, out):
    dist.init_process_group("gloo", init_method=f"{init}{world}", rank=rank, world_size=world)
    state = state_of(init_device_mesh("cpu", (world,)), [Shard(0)], False)
    dcp.load(state, checkpoint_id=export)
    with open(f"{out}{world}.{rank}", "w") as f:
        json.dump(mismatches(state), f)
    dist.destroy_process_group()

def other_rank(index, world, *args):
    rank_main(index + 1, world, *args)
    os._exit(0)  # without finalizing, as tests/integration/test_torch_mesh_change.py says why

if __name__ == "__main__":
    for world in (1, 3):  # this process is rank 0 of each; the others are spawned
        others = mp.spawn(other_rank, args=(world, *sys.argv[1:]), nprocs=world - 1, join=False) if world > 1 else None
        rank_main(0, world, *sys.argv[1:])
        while others is not None and not others.join():
            pass
    os._exit(0)
"""
)


@functools.cache
def torch_site() -> str:
    """The PyTorch venv's site-packages."""
    return subprocess.run(
        [str(TORCH_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def mtc_export(*args: str) -> subprocess.CompletedProcess:
    """``mtc export`` in the agent's Python with torch's site-packages after its own (the two venvs of this
    repository; an install of ``mtc-checkpointing[torch]`` has both)."""
    code = (
        f"import sys; sys.path.append({torch_site()!r}); from replicator.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, "export", *args], capture_output=True, text=True, timeout=240, env=env
    )


@pytest.fixture(scope="module")
def store_url(fsdp, tmp_path_factory) -> str:
    """Step 1 of the FSDP job backed up as the agents do it: each node's files, its manifest, then COMMIT."""
    root = tmp_path_factory.mktemp("store")
    store = open_backup_store(f"file://{root}")
    for n in range(2):
        step_dir = str(fsdp / f"node{n}" / "1")
        store.upload_rank(RankUpload(JobRef("ns", JOB), 1, n, step_dir, build_manifest(step_dir, 1, n)))
    assert store.commit_if_complete(JobRef("ns", JOB), 1, nodes=2)
    return f"file://{root}"


def test_mtc_export_from_the_backup_store_loads_with_stock_dcp_without_mtc(store_url, tmp_path):
    export = tmp_path / "export"
    done = mtc_export("--backup", store_url, "--namespace", "ns", "--job", JOB, "--to", str(export))
    assert done.returncode == 0, done.stderr
    assert f"to {export} as dcp" in done.stdout
    script = tmp_path / "stock.py"
    script.write_text(_STOCK)
    out = tmp_path / "stock"
    result = subprocess.run(
        [str(TORCH_PYTHON), "-I", "-S", str(script), str(export), f"file://{tmp_path}/init", str(out), torch_site()],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for world in (1, 3):
        assert [json.loads(Path(f"{out}{world}.{r}").read_text()) for r in range(world)] == [[]] * world


def test_mtc_export_refuses_a_backup_whose_bytes_fail_their_checksum(store_url, tmp_path):
    root = Path(store_url.removeprefix("file://"))
    data = sorted((root / "ns" / JOB / "steps" / "1" / "rank-1").rglob("*.distcp"))[0]
    corrupt = tmp_path / "store"
    shutil.copytree(root, corrupt)
    target = corrupt / data.relative_to(root)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    done = mtc_export("--backup", f"file://{corrupt}", "--namespace", "ns", "--job", JOB, "--to", str(tmp_path / "x"))
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("mtc export: ") and "crc32c mismatch" in line, done.stderr
    assert not (tmp_path / "x").exists()


def test_mtc_export_of_a_step_dir_checks_its_manifests_and_writes_safetensors(fsdp, tmp_path):
    both = multi_node(fsdp, tmp_path / "both")
    manifests = []
    for n in range(2):
        manifests += ["--manifest", str(tmp_path / f"m{n}.json")]
        Path(manifests[-1]).write_text(build_manifest(str(both / f"node-{n}-of-2"), 1, n).to_json())
    out = tmp_path / "hf"
    done = mtc_export("--step-dir", str(both), *manifests, "--format", "safetensors", "--to", str(out))
    assert done.returncode == 0, done.stderr
    assert "left out (not tensors): extra.count" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    (both / "node-1-of-2" / "rank-0-of-2" / ".metadata").write_bytes(b"changed")
    done = mtc_export("--step-dir", str(both), *manifests, "--to", str(tmp_path / "y"))
    assert done.returncode == 1 and "does not match its manifest" in done.stderr, done.stderr
