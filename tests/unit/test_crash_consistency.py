"""Crashes at the worst moment leave nothing half-done under a name anyone reads (no processes)."""

import os

import pytest

from csi_driver.ramdisk import Ramdisk
from prefetch.restore import hand_over
from replicator.local_tier import frameworks, pod_files, steps
from replicator.local_tier.frameworks import orbax
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.step_manifest import build_manifest
from tests.helpers.steps import write_tree

ORBAX = frameworks.get("orbax")


def test_a_crash_mid_delete_leaves_no_partial_step_and_the_next_start_finishes_it(tmp_path, monkeypatch):
    client = tmp_path / "client"
    write_tree(client / "4", {"_CHECKPOINT_METADATA": b"{}", "state/a": b"x" * 100})

    def crash(fd, name):
        raise KeyboardInterrupt("the agent dies here")

    monkeypatch.setattr(pod_files, "remove", crash)
    with pytest.raises(KeyboardInterrupt):
        steps.delete_step(ORBAX, str(client), 4)
    monkeypatch.undo()
    assert ORBAX.scan_steps(str(client)).held == []  # never seen as a (partial) step
    assert any(name.startswith(".mtc-trash-") for name in os.listdir(client))
    steps.sweep_trash(str(client))
    assert os.listdir(client) == []


def test_replicas_without_a_manifest_are_swept_at_start(tmp_path):
    meta = JobMeta(str(tmp_path))
    incoming = meta.new_incoming_dir()
    write_tree(incoming, {"_CHECKPOINT_METADATA": b"{}"})
    meta.install_replica(incoming, build_manifest(incoming, 3, 1))
    partial = meta.replica_dir(1, 4)
    write_tree(partial, {"half": b"x"})  # a push that died before its manifest
    meta.sweep_partial()
    assert set(meta.replicas()) == {(1, 3)} and not os.path.exists(partial)
    assert os.path.isdir(meta.replica_dir(1, 3))


def test_a_replayed_hand_over_never_clears_steps_written_since(tmp_path):
    disk = Ramdisk("default", "run", 1 << 20, str(tmp_path))
    meta = JobMeta(disk.path)
    write_tree(os.path.join(disk.client_dir, ORBAX.staged_name(5)), {"_CHECKPOINT_METADATA": b"{}"})
    write_tree(os.path.join(disk.client_dir, "7"), {"_CHECKPOINT_METADATA": b"{}"})  # newer, not restorable everywhere
    progress = PodProgress("uid", "inc", 0, "h:1", True)
    hand_over(disk, meta, progress, 5, "local")
    marker = os.path.join(disk.client_dir, orbax.restore_marker_name("run", 5, 0))
    assert os.path.islink(marker) and ORBAX.scan_steps(disk.client_dir).committed == []
    # Orbax takes the marker and trains on; then the agent crashes before recording restore_done.
    os.replace(marker, os.path.join(disk.client_dir, "5"))
    write_tree(os.path.join(disk.client_dir, "8"), {"_CHECKPOINT_METADATA": b"{}"})
    progress.restore_done = False
    hand_over(disk, meta, progress, 5, "resumed")
    assert ORBAX.scan_steps(disk.client_dir).committed == [5, 8]  # step 8 survived the replay
    assert not os.path.lexists(marker)  # and no second marker for Orbax to trip over
    assert progress.restore_done and meta.progress("uid").restore_done
