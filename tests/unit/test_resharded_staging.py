"""An elastic restore's staged directory on a node (``prefetch.resharded``): copies held here are hard-linked and
verified, the job's link to the directory is no step of the node, and the directory goes once the job trains past it."""

import os

import pytest

from prefetch import resharded
from replicator.local_tier import frameworks
from replicator.local_tier.step_manifest import CorruptCopy, build_manifest
from tests.unit.test_pytorch_framework import resiliency_takes_the_marker

pytestmark = pytest.mark.unit

TORCH = frameworks.get("pytorch.distributed")


def a_step(path, payload: bytes = b"shard") -> None:
    for rank in range(2):
        (path / f"rank-{rank}-of-2").mkdir(parents=True)
        (path / f"rank-{rank}-of-2" / ".metadata").write_bytes(b"m%d" % rank)
        (path / f"rank-{rank}-of-2" / "__0_0.distcp").write_bytes(payload)


def test_a_copy_held_here_is_linked_not_copied_and_a_changed_one_is_refused_leaving_nothing(tmp_path):
    a_step(tmp_path / "7")
    manifest = build_manifest(str(tmp_path / "7"), 7, 0, None, 0)
    part = tmp_path / "building" / "node-0-of-2"
    resharded.link_copy(str(tmp_path / "7"), manifest, str(part), "own step 7")
    linked = part / "rank-1-of-2" / "__0_0.distcp"
    assert (
        linked.read_bytes() == b"shard"
        and os.stat(linked).st_ino == os.stat(tmp_path / "7" / "rank-1-of-2" / "__0_0.distcp").st_ino
    )
    (tmp_path / "8").mkdir()
    a_step(tmp_path / "8", b"other")
    with pytest.raises(CorruptCopy):
        resharded.link_copy(str(tmp_path / "8"), manifest, str(tmp_path / "building" / "node-1-of-2"), "step 8")
    assert not (tmp_path / "building" / "node-1-of-2").exists()


def test_the_jobs_link_to_the_resharded_step_is_no_step_of_this_node_and_goes_after_a_newer_commit(tmp_path):
    a_step(tmp_path / "7")  # this node's own old step stays its step 7
    building = tmp_path / "building"
    a_step(building / "node-0-of-2")
    a_step(building / "node-1-of-2")
    resharded.install(TORCH, str(tmp_path), 7, str(building))
    TORCH.write_restore_marker(str(tmp_path), "llama", 7, 0, resharded=True)
    assert resharded.linked(str(tmp_path), ".mtc-resharded-7")
    announced, path = resiliency_takes_the_marker(tmp_path)
    assert announced == 7 and sorted(os.listdir(path)) == ["node-0-of-2", "node-1-of-2"]
    scan = TORCH.scan_steps(str(tmp_path))
    assert (scan.committed, scan.staged, scan.refused) == ([7], [], [])
    assert TORCH.find_step_dir(str(tmp_path), 7) == str(tmp_path / "7")
    resharded.drop_resharded(str(tmp_path), lambda step: step >= 7)  # a commit of step 7 keeps it
    assert (tmp_path / ".mtc-resharded-7").is_dir()
    resharded.drop_resharded(str(tmp_path), lambda step: step >= 10)  # the job committed step 10
    assert sorted(os.listdir(tmp_path)) == ["7", "replicator.prerestore"]
