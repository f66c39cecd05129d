"""RamdiskManager on real tmpfs mounts: recovery after a crash or a reboot, retention of idle ramdisks."""

import os

import pytest

from csi_driver import mounts
from csi_driver.ramdisk import JobBusy, RamdiskManager, TmpfsBackend
from examples.local_cluster import unmount_all_below
from tests.helpers.ramdisks import ignore_new_pod, spec
from tests.helpers.tools import requires_root

pytestmark = requires_root


@pytest.fixture
def tmpfs_manager(tmp_path):
    yield RamdiskManager(str(tmp_path / "root"), TmpfsBackend(), on_new_pod=ignore_new_pod)
    unmount_all_below(str(tmp_path))


def test_recover_adopts_tmpfs_missing_from_state_and_drops_vanished_ones(tmp_path, tmpfs_manager):
    tmpfs_manager.publish("v1", str(tmp_path / "t1"), spec("kept"))
    gone = tmpfs_manager.publish("v2", str(tmp_path / "t2"), spec("gone"))
    # A crash between mount and state save: the tmpfs exists, the state file does not know it.
    orphan = os.path.join(tmpfs_manager.root, "jobs", "default", "orphan")
    os.makedirs(orphan)
    mounts.mount_tmpfs(orphan, 4 << 20)
    # A node reboot lost one ramdisk (and the pod's bind on it).
    mounts.unmount(str(tmp_path / "t2"))
    mounts.unmount(gone.path)

    survivors = {
        (d.namespace, d.job): d
        for d in RamdiskManager(tmpfs_manager.root, TmpfsBackend(), on_new_pod=ignore_new_pod).recover()
    }
    assert set(survivors) == {("default", "kept"), ("default", "orphan")}
    assert survivors[("default", "orphan")].size_bytes == 4 << 20
    assert survivors[("default", "orphan")].idle_since is not None
    assert list(survivors[("default", "kept")].publications) == [str(tmp_path / "t1")]


def test_retention_releases_only_idle_ramdisks_past_ttl(tmp_path, tmpfs_manager):
    tmpfs_manager.publish("v1", str(tmp_path / "busy"), spec("busy"))
    tmpfs_manager.publish("v2", str(tmp_path / "idle"), spec("idle"))
    idle = tmpfs_manager.unpublish(str(tmp_path / "idle"))
    assert tmpfs_manager.reap_idle(retention_seconds=3600) == []
    released = tmpfs_manager.reap_idle(retention_seconds=3600, now=idle.idle_since + 3601)
    assert released == [("default", "idle")]
    assert mounts.find_mount(idle.path) is None
    with pytest.raises(JobBusy):
        tmpfs_manager.release("default", "busy")
