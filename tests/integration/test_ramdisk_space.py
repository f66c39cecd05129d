"""Space on a real, small tmpfs: a replica is received only beside room for the job's next save, and
pressure gives up only unsafe, unprotected copies, oldest first."""

import os

import pytest

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier import space
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import build_manifest
from replicator.peer_tier.client import PeerFetchError, push_step
from replicator.wire.messages import RetainOrder
from tests.helpers.peer import JOB, NS, TOKEN, commit_own_step
from tests.helpers.ramdisks import small_tmpfs
from tests.helpers.steps import write_tree
from tests.helpers.tools import requires_root

pytestmark = requires_root
MiB = 1 << 20


@pytest.fixture
def ramdisk(tmp_path):
    """A real 12 MiB tmpfs, always unmounted."""
    with small_tmpfs(str(tmp_path / "ramdisk"), "12M") as path:
        yield path


def _replica(meta, tmp_path, rank: int, step: int, size: int) -> None:
    """Installs ``rank``'s ``step`` of ``size`` bytes as a replica, as a verified push would."""
    incoming = meta.new_incoming_dir()
    write_tree(incoming, {"a": os.urandom(size)})
    meta.install_replica(incoming, build_manifest(incoming, step, rank))


async def test_push_that_would_leave_no_room_for_the_next_save_is_507_before_a_byte(serve, session, ramdisk, tmp_path):
    peer = await serve(ramdisk)
    commit_own_step(peer.meta, 1, 0, {"a": os.urandom(3 * MiB)})  # the job's saves: 3 MiB, so 3.3 MiB kept free
    first = write_tree(str(tmp_path / "first"), {"a": os.urandom(3 * MiB)})
    await push_step(
        session, peer.base_url, TOKEN, NS, JOB, first, build_manifest(first, 1, 1)
    )  # 12 - 3 - 3 = 6 MiB free

    # 2 files of 1 MiB: each fits on its own, and the step fits in the free space, but not beside the next save.
    second = write_tree(str(tmp_path / "second"), {"a": os.urandom(MiB), "b": os.urandom(MiB)})
    third = write_tree(str(tmp_path / "third"), {"a": os.urandom(MiB), "b": os.urandom(2 * MiB)})
    await push_step(session, peer.base_url, TOKEN, NS, JOB, second, build_manifest(second, 2, 1), concurrency=1)
    free = space.free_bytes(ramdisk)
    with pytest.raises(
        PeerFetchError, match=r"HTTP 507.*\(3145728 bytes\) does not fit: .* keeps 3460300 for the job's next save"
    ):
        await push_step(session, peer.base_url, TOKEN, NS, JOB, third, build_manifest(third, 3, 1), concurrency=1)
    assert peer.incoming() == [] and set(peer.meta.replicas()) == {(1, 1), (1, 2)}
    assert space.free_bytes(ramdisk) == free
    commit_own_step(peer.meta, 2, 0, {"a": os.urandom(3 * MiB)})  # the job's next save still fits: no ENOSPC


def test_pressure_gives_up_unsafe_unprotected_copies_oldest_first(ramdisk, tmp_path):
    disk = Ramdisk(NS, JOB, 12 * MiB, ramdisk)
    meta = JobMeta(ramdisk)
    for step in (1, 2, 3, 4, 5):
        commit_own_step(meta, step, 0, {"a": os.urandom(MiB)})
    for step in (2, 3, 5):
        _replica(meta, tmp_path, 1, step, MiB)
    order = RetainOrder(NS, JOB, keep_from=2, protected=(4,))  # safe step 2; the round's step 4
    everything = space.free_bytes(ramdisk) + 8 * MiB

    assert space.make_room(disk, None, set(), everything) == []  # nothing safe: nothing is given up
    given = space.make_room(disk, order, set(), everything)
    # Step 3 (replica first, then own) only: 1 and 2 are the safe step and older, 4 is protected, 5 is the newest save.
    assert [(g.rank, g.step, g.own) for g in given] == [(1, 3, False), (0, 3, True)]
    assert sorted(meta.manifests()) == [1, 2, 4, 5] and sorted(meta.replicas()) == [(1, 2), (1, 5)]
    assert sorted(os.listdir(meta.client_dir)) == ["1", "2", "4", "5"]

    commit_own_step(meta, 6, 0, {"a": os.urandom(MiB)})
    assert space.make_room(disk, order, {5}, everything) == []  # 5 is being pushed: kept
    need = space.free_bytes(ramdisk) + MiB // 2
    given = space.make_room(disk, order, set(), need)
    assert [(g.rank, g.step) for g in given] == [(1, 5)]  # stops as soon as the room is there
    assert space.free_bytes(ramdisk) >= need and sorted(meta.manifests()) == [1, 2, 4, 5, 6]


def test_pressure_keeps_replicas_that_arrived_after_the_order(ramdisk, tmp_path):
    disk = Ramdisk(NS, JOB, 12 * MiB, ramdisk)
    meta = JobMeta(ramdisk)
    for step in (1, 2, 3, 4):
        commit_own_step(meta, step, 0, {"a": os.urandom(MiB)})
    _replica(meta, tmp_path, 1, 2, MiB)
    order = RetainOrder(NS, JOB, keep_from=1, protected=())  # made before the coordinator chose round 3
    asked = meta.replica_installed_at(1, 2) + 0.01
    os.utime(meta.replica_dir(1, 2) + ".json", (asked - 1, asked - 1))  # installed before the node asked for the order
    _replica(meta, tmp_path, 1, 3, MiB)
    os.utime(meta.replica_dir(1, 3) + ".json", (asked + 1, asked + 1))  # the round's push, after it
    everything = space.free_bytes(ramdisk) + 8 * MiB

    given = space.make_room(disk, order, set(), everything, order_asked_at=asked)
    # Rank 1's replica of 3 is kept: the order cannot say whether it is the round's. 4 is the newest save.
    assert [(g.rank, g.step, g.own) for g in given] == [(1, 2, False), (0, 2, True), (0, 3, True)]
    assert sorted(meta.replicas()) == [(1, 3)]
    # An order asked for after it judges it like any other copy.
    assert [(g.rank, g.step) for g in space.make_room(disk, order, set(), everything, order_asked_at=asked + 2)] == [
        (1, 3)
    ]
