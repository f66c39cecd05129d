"""A restore never deletes the last copy of a newer step: steps newer than the restored one are set
aside, stay reported and restorable, and go only once a step newer than the restored one is safe
(real files on a real directory, the real node agent code; no processes)."""

import os

import pytest

from csi_driver.ramdisk import Publication, Ramdisk
from csi_driver.volume_request import parse_volume_context
from prefetch import staging
from prefetch.restore import hand_over
from replicator.local_tier import frameworks
from replicator.local_tier.job_keys import BusySteps
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.step_manifest import CorruptCopy, build_manifest
from replicator.local_tier.steps import drop_abandoned
from replicator.node.agent import build_replicator
from replicator.node.commit_detection import CommitDetector
from replicator.node.config import CoordinatorSettings, CsiSettings, NodeConfig, PeerSettings
from replicator.node.garbage_collection import collect_garbage
from replicator.wire.messages import JobRef, RetainOrder
from tests.helpers.steps import write_tree

ORBAX = frameworks.get("orbax")
RANK = 1


def committed(disk, meta, step):
    path = write_tree(
        os.path.join(disk.client_dir, str(step)), {"_CHECKPOINT_METADATA": b"{}", "state/a": bytes([step]) * 64}
    )
    meta.save_manifest(build_manifest(path, step, RANK))


def restored_at(tmp_path, step, newer):
    disk = Ramdisk("default", "run", 1 << 20, str(tmp_path))
    context = {
        "csi.storage.k8s.io/pod.name": "run-0-0-x",
        "csi.storage.k8s.io/pod.uid": "uid",
        "job": "run",
        "nodes": "2",
    }
    disk.publications["t"] = Publication("v", False, parse_volume_context(context, 1 << 20), 0.0)
    meta = JobMeta(disk.path)
    for s in [step, *newer]:
        committed(disk, meta, s)
    config = NodeConfig(
        "n",
        str(tmp_path),
        CsiSettings("unix:///n.sock"),
        PeerSettings("127.0.0.1:1"),
        coordinator=CoordinatorSettings("http://coordinator"),
    )
    replicator = build_replicator(config, "http://coordinator", None)
    progress = PodProgress("uid", "inc", RANK, "h:1", True)
    staging.stage_local(ORBAX, disk.client_dir, step, meta.manifests()[step], meta, RANK)
    hand_over(disk, meta, progress, step, "local")
    return disk, meta, replicator


def test_newer_steps_are_set_aside_not_deleted_and_stay_reported(tmp_path):
    disk, meta, replicator = restored_at(tmp_path, 3, [6, 9])
    assert ORBAX.scan_steps(disk.client_dir).committed == []  # Orbax sees only the marker's step
    assert set(meta.manifests()) == {3}
    assert set(meta.replicas()) == {(RANK, 6), (RANK, 9)}
    report = replicator._build_report({JobRef("default", "run"): disk})
    held = {(h.step, h.rank, h.replica) for h in report.held}
    assert {(6, RANK, True), (9, RANK, True)} <= held


def test_a_set_aside_step_is_restored_verified_and_a_corrupt_one_refused(tmp_path):
    disk, meta, _ = restored_at(tmp_path, 3, [6, 9])
    staging.stage_local(ORBAX, disk.client_dir, 9, None, meta, RANK)
    assert ORBAX.scan_steps(disk.client_dir).staged[-1] == 9 and 9 in meta.manifests()
    assert (RANK, 9) not in meta.replicas()
    with open(os.path.join(meta.replica_dir(RANK, 6), "state", "a"), "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(CorruptCopy, match="state/a: crc32c mismatch"):
        staging.stage_local(ORBAX, disk.client_dir, 6, None, meta, RANK)
    assert (RANK, 6) in meta.replicas()


def test_set_aside_steps_go_once_a_step_newer_than_the_restored_one_is_safe(tmp_path):
    disk, meta, replicator = restored_at(tmp_path, 3, [6, 9])
    collect_garbage(disk, RetainOrder("default", "run", 3, ()), BusySteps())
    assert set(meta.replicas()) == {(RANK, 6), (RANK, 9)}  # only the restored step is safe: kept
    committed(disk, meta, 4)
    collect_garbage(disk, RetainOrder("default", "run", 4, ()), BusySteps())
    assert meta.replicas() == {} and set(meta.manifests()) == {4}  # step 3 is older than the safe step: collected too


def test_a_rollback_deletes_the_abandoned_newer_steps(tmp_path):
    disk = Ramdisk("default", "run", 1 << 20, str(tmp_path))
    meta = JobMeta(disk.path)
    for s in (3, 6, 9):
        committed(disk, meta, s)
    staging.clear_for_restore(ORBAX, disk.client_dir, 3, meta, RANK, set_aside=False)
    assert meta.replicas() == {} and set(meta.manifests()) == {3}
    assert ORBAX.scan_steps(disk.client_dir).committed == [3]


async def test_a_learnt_rollback_deletes_the_abandoned_timelines_copies_and_new_steps_carry_the_new_timeline(tmp_path):
    disk, meta, replicator = restored_at(tmp_path, 3, [6, 9])  # 6 and 9 set aside, in timeline 0
    for step in (4, 7):  # replicas of the other rank, pushed by its node
        path = write_tree(
            os.path.join(tmp_path, f"pushed-{step}"), {"_CHECKPOINT_METADATA": b"{}", "state/b": bytes([step])}
        )
        meta.install_replica(path, build_manifest(path, step, 0))
    assert meta.learn_lineage((5,)) and not meta.learn_lineage((5,)) and not meta.learn_lineage((4,))
    drop_abandoned(disk)
    assert set(meta.replicas()) == {(0, 4)} and set(meta.manifests()) == {3}  # steps after 5 of timeline 0: gone
    assert meta.locate(RANK, 9) is None and meta.locate(0, 4) is not None

    committed_again = write_tree(
        os.path.join(disk.client_dir, "6"), {"_CHECKPOINT_METADATA": b"{}", "state/a": b"new values"}
    )
    assert ORBAX.scan_steps(disk.client_dir).committed == [6] and os.path.isdir(committed_again)
    await CommitDetector(None, lambda: None).detect(
        disk, meta, PodProgress("uid", "inc", RANK, "h:1", True, restore_done=True)
    )
    assert meta.manifests()[6].timeline == 1
    report = replicator._build_report({JobRef("default", "run"): disk})
    assert {(h.step, h.rank, h.replica, h.timeline) for h in report.held} == {
        (3, RANK, False, 0),
        (6, RANK, False, 1),
        (4, 0, True, 0),
    }
    assert [(lineage.job, lineage.forks) for lineage in report.lineages] == [("run", (5,))]


def test_a_newer_step_staged_for_a_restore_replanned_to_an_older_one_is_set_aside_not_deleted(tmp_path):
    """Issue 49: the node staged its own step 9 for a restore, then the coordinator replanned to step 6 (another
    rank's holder of 9 was lost). Step 9 may be the last copy of this rank: it stays restorable, verified."""
    disk, meta, replicator = restored_at(tmp_path, 9, [])
    staging.clear_for_restore(ORBAX, disk.client_dir, 6, meta, RANK)
    assert ORBAX.scan_steps(disk.client_dir).staged == [] and 9 not in meta.manifests()
    assert set(meta.replicas()) == {(RANK, 9)}
    report = replicator._build_report({JobRef("default", "run"): disk})
    assert {(h.step, h.rank, h.replica) for h in report.held} == {(9, RANK, True)}
    staging.stage_local(ORBAX, disk.client_dir, 9, None, meta, RANK)  # the holder came back: 9 restores again
    assert ORBAX.scan_steps(disk.client_dir).staged == [9]


def test_an_older_staged_step_nothing_points_at_is_deleted_and_a_rollback_deletes_a_newer_one(tmp_path):
    disk, meta, _ = restored_at(tmp_path, 3, [])
    staging.clear_for_restore(ORBAX, disk.client_dir, 6, meta, RANK)
    assert ORBAX.scan_steps(disk.client_dir).staged == [] and meta.replicas() == {}
    disk, meta, _ = restored_at(tmp_path / "rollback", 9, [])
    staging.clear_for_restore(ORBAX, disk.client_dir, 6, meta, RANK, set_aside=False)
    assert ORBAX.scan_steps(disk.client_dir).staged == [] and meta.replicas() == {}
