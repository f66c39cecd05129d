"""``mtc_torch.StepReader``'s layouts and metadata merge, and ``export_step`` of an old-format step, in the PyTorch
venv (one script, one process: the test process has no torch).

Rank directories are written by ``DeterministicWriter`` (``dcp.save``, ``no_dist``); a rank's chunk is then placed
at another offset of a larger tensor by rewriting its ``.metadata``, as a rank of a sharded save stores it.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.torch_venv import TORCH_PYTHON, needs_torch_venv

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs_torch_venv

_SCRIPT = """
import dataclasses, json, logging, os, pickle, shutil, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from mtc_torch import PartialRestoreError, StepReader
from mtc_torch.export import export_step
from mtc_torch.storage import DeterministicWriter, load_metadata
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
root = sys.argv[1]
FULL = torch.arange(30, dtype=torch.float32).reshape(10, 3)

def rank(step, name, rows, offset, extra=None, dim=0):  # a rank storing rows (dim 1: columns) of FULL from offset
    path = os.path.join(root, step, name)
    os.makedirs(path)
    dcp.save({"w": FULL.narrow(dim, offset, rows).clone(), "n": extra if extra is not None else offset},
             storage_writer=DeterministicWriter(path), no_dist=True)
    md = load_metadata(os.path.join(path, ".metadata"))
    w = md.state_dict_metadata["w"]
    w.size = FULL.shape
    at = torch.Size([offset, 0] if dim == 0 else [0, offset])
    w.chunks[0] = dataclasses.replace(w.chunks[0], offsets=at)
    md.storage_data = {(MetadataIndex("w", at) if i.fqn == "w" else i): v for i, v in md.storage_data.items()}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return path

def direct(step):
    try:
        StepReader(os.path.join(root, step)).read_metadata()
    except ValueError as error:
        return f"ValueError: {error}"

class Logged(logging.Handler):
    def emit(self, record):
        LOGGED.append(record.getMessage())

LOGGED = []
logging.getLogger("mtc_torch").addHandler(Logged(logging.ERROR))

def load(step, **kwargs):
    target = {"w": torch.full((10, 3), float("nan")), "n": -1}
    LOGGED.clear()
    try:
        dcp.load(target, storage_reader=StepReader(os.path.join(root, step), **kwargs), no_dist=True)
    except CheckpointException as failed:
        error = type(failed.failures[0][0]).__name__ + ": " + str(failed.failures[0][0]).splitlines()[0]
        return {"error": error, "logged": list(LOGGED)}
    return target

out = {}
rank("two", "rank-0-of-2", 6, 0); rank("two", "rank-1-of-2", 4, 6)
got = load("two")
out["merged"] = torch.equal(got["w"], FULL) and got["n"] == 0
got = load("two", prefer="rank-1-of-2")
out["prefer"] = torch.equal(got["w"], FULL) and got["n"] == 6  # the preferred rank's non-tensor item
rank("columns", "rank-0-of-2", 2, 0, dim=1); rank("columns", "rank-1-of-2", 1, 2, dim=1)
got = load("columns")  # Shard(1) chunks into a whole tensor: strided boxes, through a host copy of each chunk
out["columns"] = torch.equal(got["w"], FULL)
rank("replica", "node-0-of-2/rank-0-of-1", 10, 0); rank("replica", "node-1-of-2/rank-0-of-1", 10, 0, extra=1)
got = load("replica")
out["replicas"] = torch.equal(got["w"], FULL) and got["n"] == 0
out["replica_chunks"] = len(StepReader(os.path.join(root, "replica")).read_metadata().state_dict_metadata["w"].chunks)
rank("half", "node-0-of-2/rank-0-of-2", 3, 0); rank("half", "node-0-of-2/rank-1-of-2", 3, 3)
out["partial"] = load("half")
rank("overlap", "rank-0-of-2", 6, 0); rank("overlap", "rank-1-of-2", 6, 4)
out["overlap"] = load("overlap")
rank("mixed", "rank-0-of-1", 10, 0); shutil.copytree(os.path.join(root, "mixed", "rank-0-of-1"), os.path.join(root, "mixed", "node-0-of-1", "rank-0-of-1"))
out["mixed"] = load("mixed")
rank("counts", "rank-0-of-2", 6, 0); rank("counts", "rank-1-of-3", 4, 6)
out["counts"] = load("counts")
rank("incomplete", "rank-0-of-2", 6, 0); os.makedirs(os.path.join(root, "incomplete", "rank-1-of-2"))
out["incomplete"] = load("incomplete")
path = rank("escape", "rank-0-of-1", 10, 0)
md = load_metadata(os.path.join(path, ".metadata"))
md.storage_data = {i: dataclasses.replace(v, relative_path="../x") for i, v in md.storage_data.items()}
with open(os.path.join(path, ".metadata"), "wb") as f:
    pickle.dump(md, f)
out["escape"] = load("escape")
rank("dtype", "rank-0-of-2", 6, 0)
os.makedirs(os.path.join(root, "dtype", "rank-1-of-2"))
dcp.save({"w": FULL.double()}, storage_writer=DeterministicWriter(os.path.join(root, "dtype", "rank-1-of-2")), no_dist=True)
out["dtype"] = load("dtype")
# A step as mtc_torch wrote them before raw bytes (torch.save items, no save_id or path) exports, and the export
# loads with torch alone.
class EarlierWriter(FileSystemWriter):
    def storage_meta(self):
        return StorageMeta()

os.makedirs(os.path.join(root, "old", "rank-0-of-1"))
state = {"w": FULL, "b": torch.arange(5).to(torch.bfloat16), "n": 3}
dcp.save(state, storage_writer=EarlierWriter(os.path.join(root, "old", "rank-0-of-1")), no_dist=True)
export_step(os.path.join(root, "old"), os.path.join(root, "old-export"), threads=2)
target = {"w": torch.zeros(10, 3), "b": torch.zeros(5, dtype=torch.bfloat16), "n": 0}
dcp.load(target, storage_reader=FileSystemReader(os.path.join(root, "old-export")), no_dist=True)
out["old_export"] = torch.equal(target["w"], FULL) and torch.equal(target["b"], state["b"]) and target["n"] == 3
try:
    export_step(os.path.join(root, "half"), os.path.join(root, "half-export"))
except PartialRestoreError as error:
    out["partial_export"] = str(error).splitlines()[0][:200]
for case in ("mixed", "counts", "incomplete", "escape", "dtype"):
    out[f"{case}_direct"] = direct(case)
out["partial_export_left"] = sorted(n for n in os.listdir(root) if "half-export" in n)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    done = subprocess.run(
        [str(TORCH_PYTHON), "-c", _SCRIPT, str(root)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ranks_chunks_merge_into_one_tensor_and_the_preferred_rank_gives_the_non_tensor_items(result):
    assert result["merged"] is True
    assert result["prefer"] is True


def test_column_chunks_load_into_a_whole_tensor(result):
    assert result["columns"] is True


def test_a_replicas_identical_chunk_is_taken_once_from_the_first_node(result):
    assert result["replicas"] is True
    assert result["replica_chunks"] == 1


def test_a_step_missing_chunks_or_overlapping_them_is_refused(result):
    partial, overlap = result["partial"]["error"], result["overlap"]["error"]
    assert partial.startswith("PartialRestoreError: ")
    assert "'w' wants [offsets [0, 0] sizes [10, 3]]" in partial
    assert overlap.startswith("ValueError: ") and "overlapping chunks" in overlap


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("mixed", "mixes node-*-of-N and rank-*-of-W directories"),
        ("counts", "disagree on the number of local ranks: [2, 3]"),
        ("incomplete", "holds no .metadata: an incomplete rank directory"),
        ("escape", "names '../x', outside its directory"),
        ("dtype", "'w' is stored here as another type, dtype or size than in another rank's"),
    ],
)
def test_a_malformed_step_is_refused_with_what_is_wrong(result, case, words):
    # Within dcp.load, DCP turns the reader's ValueError into its AssertionError("metadata is None; ..."), which
    # torch 2.11 leaves at "metadata is None": the reader's log line says what is wrong, once, whatever the torch.
    refused = result[case]
    assert refused["error"].startswith("AssertionError: metadata is None"), refused
    assert len(refused["logged"]) == 1 and words in refused["logged"][0], refused
    assert result[f"{case}_direct"].startswith("ValueError: ") and words in result[f"{case}_direct"]


def test_an_old_format_step_exports_and_a_partial_one_is_refused_leaving_nothing(result):
    assert result["old_export"] is True
    assert "refusing a partial restore" in result["partial_export"]
    assert result["partial_export_left"] == []
