"""TorchTitan 0.3.0's own checkpoint options through ``MtcCheckpointManager``: the initial load, the last step's
export to ``checkpoint.folder``, and the options it refuses.

One torchrun job of 2 ranks (gloo, CPU) builds TorchTitan's llama3 debug model and its real Hugging Face state dict
adapter, and runs the manager as TorchTitan's trainer builds it (``config.checkpoint.build(...)``) against a fake
node agent per ramdisk directory (``tests/helpers/torch_agent.py``). Each phase fills the model with the values of
its own seed, so a load is told apart by its values:

- a stock ``dcp.save`` of the model is loaded from ``initial_load_path`` on a fresh start;
- when the agent restores a step of ours, that step wins over ``initial_load_path``;
- the last step is written as TorchTitan writes it: a model-only stock DCP checkpoint in ``export_dtype``, or Hugging
  Face safetensors (``last_save_in_hf``), which TorchTitan's own HF load and ``safetensors`` read back, values equal;
- the options it cannot honour refuse at start, one line naming the option.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.torch_agent import FakeTorchAgent
from tests.helpers.torch_venv import TORCH_PYTHON, needs_torch_venv

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs_torch_venv
JOB = "titan"
REFUSED = [
    {"keep_latest_k": 5},
    {"load_step": 2},
    {"exclude_from_loading": ["optimizer"]},
    {"create_seed_checkpoint": True},
]

# argv: base dir, then the refused options as JSON.
_SCRIPT = """
import json, os, shutil, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.models.llama3 import model_registry
from mtc_torch.torchtitan import MtcCheckpointManager

base, refused = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
spec = model_registry("debugmodel", attn_backend="flex")
model = spec.model.build()

def fill(seed):
    # Every floating-point tensor of the model's state: values of the seed, the same on each rank. Through
    # load_state_dict: the fused attention projections' wq, wk, wv are views a state_dict hook makes.
    generator = torch.Generator().manual_seed(seed)
    model.load_state_dict({k: torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
                           for k, v in model.state_dict().items()})
    return {k: v.clone() for k, v in model.state_dict().items()}

def mismatches(expected):
    return sorted(k for k, v in model.state_dict().items() if not torch.equal(v, expected[k]))

class Value(Stateful):  # the optimizer, LR schedulers and train state: one number each
    def __init__(self):
        self.value = torch.zeros(())
    def state_dict(self):
        return {"value": self.value}
    def load_state_dict(self, state):
        self.value = state["value"]

def manager(local, dump, **options):
    config = MtcCheckpointManager.Config(enable=True, local_dir=f"{base}/{local}", job_name="titan",
                                         backup_interval_steps=100, async_save=False, **options)
    optimizer = Value()
    built = config.build(dataloader=None, model_parts=[model], optimizers=optimizer, lr_schedulers=Value(),
                         states={"train_state": Value()}, sd_adapter=spec.state_dict_adapter(spec.model, None),
                         base_folder=f"{base}/{dump}")
    return built, optimizer

out = {}
initial = fill(1)
dcp.save(model.state_dict(), checkpoint_id=f"{base}/initial")  # as another job or a seed checkpoint writes it

# A fresh start: the agent restores nothing, the initial checkpoint is loaded (model only, TorchTitan's default).
fill(2)
job, optimizer = manager("fresh", "dump", initial_load_path=f"{base}/initial", export_dtype="bfloat16")
out["fresh"] = {"loaded": job.load(), "mismatches": mismatches(initial)}
ours = fill(3)
optimizer.value.fill_(3.0)
job.save(3, last_step=True)  # our step 3, then TorchTitan's model-only DCP export in bfloat16
job.close()
export = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in ours.items()}
dcp.load(export, checkpoint_id=f"{base}/dump/checkpoint/step-3")
out["dcp_export"] = sorted(k for k, v in export.items() if not torch.equal(v, ours[k].to(torch.bfloat16)))

# A restart where the agent restores our step 3: it wins over initial_load_path.
if rank == 0:
    shutil.copytree(f"{base}/fresh/3", f"{base}/restart/.staged-3")
dist.barrier()
fill(2)
job, optimizer = manager("restart", "dump", initial_load_path=f"{base}/initial", last_save_in_hf=True)
out["restart"] = {"loaded": job.load(), "mismatches": mismatches(ours), "optimizer": float(optimizer.value)}
final = fill(4)
job.save(4, last_step=True)  # our step 4, then TorchTitan's Hugging Face export
job.close()

# The Hugging Face export read by TorchTitan's own HF load (initial_load_in_hf) and by safetensors.
fill(2)
job, _ = manager("hf", "dump-hf", initial_load_path=f"{base}/dump/checkpoint/step-4", initial_load_in_hf=True)
out["hf"] = {"loaded": job.load(), "mismatches": mismatches(final)}
job.close()
hf = load_file(f"{base}/dump/checkpoint/step-4/model-00001-of-00001.safetensors")
out["hf_embeddings"] = torch.equal(hf["model.embed_tokens.weight"], final["tok_embeddings.weight"])

out["refused"] = []
for options in refused:
    try:
        manager("never", "dump-never", **options)
        out["refused"].append(None)
    except ValueError as error:
        out["refused"].append(str(error))
with open(f"{base}.rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
os._exit(0)  # without finalizing, as tests/integration/test_torch_mesh_change.py says why
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of the job."""
    base = tmp_path_factory.mktemp("titan") / "job"
    for local in ("fresh", "restart", "hf"):
        (base / local).mkdir(parents=True)
    script = base.parent / "job.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with (
        FakeTorchAgent(base / "fresh", JOB),
        FakeTorchAgent(base / "restart", JOB, restore_step=3, staged=".staged-3"),
        FakeTorchAgent(base / "hf", JOB),
    ):
        result = subprocess.run(
            [str(TORCH_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
            + ["--nproc-per-node", "2", str(script), str(base), json.dumps(REFUSED)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{base}.rank{r}.json").read_text()) for r in range(2)]


def test_a_fresh_start_loads_initial_load_path_a_stock_dcp_checkpoint(ranks):
    assert [r["fresh"] for r in ranks] == [{"loaded": True, "mismatches": []}] * 2


def test_a_restored_step_of_ours_wins_over_initial_load_path(ranks):
    assert [r["restart"] for r in ranks] == [{"loaded": True, "mismatches": [], "optimizer": 3.0}] * 2


def test_the_last_step_is_exported_as_torchtitan_writes_it_model_only_in_export_dtype(ranks):
    assert [r["dcp_export"] for r in ranks] == [[]] * 2


def test_the_last_step_hugging_face_export_loads_with_torchtitans_hf_loader_and_safetensors(ranks):
    assert [r["hf"] for r in ranks] == [{"loaded": True, "mismatches": []}] * 2
    assert [r["hf_embeddings"] for r in ranks] == [True] * 2


def test_options_it_cannot_honour_refuse_at_start_naming_the_option(ranks):
    refused = "checkpoint.{} is not supported with MtcCheckpointManager: {}"
    expected = [
        refused.format("keep_latest_k=5", "the node agent keeps steps (replicator.yaml)"),
        refused.format("load_step=2", "the node agent restores the newest complete step"),
        refused.format("exclude_from_loading=['optimizer']", "a restore loads every saved state"),
        refused.format(
            "create_seed_checkpoint",
            "write the seed with TorchTitan's own checkpointer and point initial_load_path at it",
        ),
    ]
    assert [r["refused"] for r in ranks] == [expected] * 2
