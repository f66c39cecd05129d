"""Garbage collection keeps the steps a push or an upload is reading, of that job only, while it reads."""

import os
import time

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier.job_keys import BusySteps, by_job, job_of
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import build_manifest
from replicator.node.garbage_collection import collect_garbage
from replicator.wire.messages import JobRef, RetainOrder
from tests.helpers.steps import write_tree


def commit(disk: Ramdisk, meta: JobMeta, step: int) -> None:
    path = write_tree(
        os.path.join(disk.client_dir, str(step)), {"_CHECKPOINT_METADATA": b"{}", "state/a": bytes([step]) * 64}
    )
    meta.save_manifest(build_manifest(path, step, 0))


def test_a_step_being_read_survives_garbage_collection_until_the_read_ends(tmp_path):
    disk = Ramdisk("default", "run", 1 << 20, str(tmp_path / "run"))
    meta = JobMeta(disk.path)
    for step in (1, 2, 3):
        commit(disk, meta, step)
    busy = BusySteps()
    with busy.reading(JobRef("default", "run"), 1), busy.reading(JobRef("default", "other"), 2):
        assert busy.of(job_of(disk)) == {1} and busy.of(JobRef("other-ns", "run")) == set()
        collect_garbage(disk, RetainOrder("default", "run", 3, ()), busy)
        assert set(meta.manifests()) == {1, 3}  # step 2 is busy in another job only: collected
        assert os.path.isdir(os.path.join(disk.client_dir, "1")) and not os.path.exists(
            os.path.join(disk.client_dir, "2")
        )
    assert busy.of(job_of(disk)) == set()
    collect_garbage(disk, RetainOrder("default", "run", 3, ()), busy)
    assert set(meta.manifests()) == {3}


def test_a_step_two_readers_share_stays_busy_until_the_last_one_ends():
    busy, job = BusySteps(), JobRef("default", "run")
    with busy.reading(job, 4):  # a push
        with busy.reading(job, 4):  # an upload of the same step, ending first
            assert busy.of(job) == {4}
        assert busy.of(job) == {4}
    assert busy.of(job) == set()


def test_the_csi_drivers_ramdisks_are_keyed_by_jobref_on_the_node_side(tmp_path):
    disks = {(ns, job): Ramdisk(ns, job, 1, str(tmp_path / f"{ns}-{job}")) for ns, job in [("a", "x"), ("b", "x")]}
    keyed = by_job(disks)
    assert keyed == {JobRef("a", "x"): disks[("a", "x")], JobRef("b", "x"): disks[("b", "x")]}
    assert {str(job) for job in keyed} == {"a/x", "b/x"}


def test_a_step_a_restore_was_told_to_stage_after_the_order_was_asked_for_is_not_that_orders_to_delete(tmp_path):
    """Issue 49: the reply to a report sent before a restore was replanned to step 2 keeps from step 3; the node
    staged step 2 meanwhile. That order keeps step 2; the next one, asked for after the plan, decides."""
    disk = Ramdisk("default", "run", 1 << 20, str(tmp_path / "run"))
    meta = JobMeta(disk.path)
    for step in (1, 2, 3):
        commit(disk, meta, step)
    busy, job = BusySteps(), job_of(disk)
    asked = time.monotonic()
    busy.restoring(job, 2)
    collect_garbage(disk, RetainOrder("default", "run", 3, ()), busy, asked)
    assert set(meta.manifests()) == {2, 3} and os.path.isdir(os.path.join(disk.client_dir, "2"))
    collect_garbage(disk, RetainOrder("default", "run", 3, ()), busy, time.monotonic())
    assert set(meta.manifests()) == {3} and busy.restored_after(job, asked) == set()  # forgotten once superseded
