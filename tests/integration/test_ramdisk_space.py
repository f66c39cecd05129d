"""Space on a real, small tmpfs: a replica is received only beside room for the job's next save, and
pressure gives up only unsafe, unprotected copies, oldest first."""

import os

import pytest

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier import space
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.parity_shards import ParityShards, ShardMeta
from replicator.local_tier.space import Copy
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
    assert [(g.rank, g.step, g.kind) for g in given] == [(1, 3, Copy.REPLICA), (0, 3, Copy.OWN)]
    assert sorted(meta.manifests()) == [1, 2, 4, 5] and sorted(meta.replicas()) == [(1, 2), (1, 5)]
    assert sorted(os.listdir(meta.client_dir)) == ["1", "2", "4", "5"]

    commit_own_step(meta, 6, 0, {"a": os.urandom(MiB)})
    assert space.make_room(disk, order, {5}, everything) == []  # 5 is being pushed: kept
    need = space.free_bytes(ramdisk) + MiB // 2
    given = space.make_room(disk, order, set(), need)
    assert [(g.rank, g.step) for g in given] == [(1, 5)]  # stops as soon as the room is there
    assert space.free_bytes(ramdisk) >= need and sorted(meta.manifests()) == [1, 2, 4, 5, 6]


def _shard(ramdisk, step: int, group: int, stripe: int, size: int) -> None:
    """Installs a parity shard of ``size`` bytes for ``group``'s ``step``, as an encode would (written in the
    ramdisk's incoming area first)."""
    written = os.path.join(JobMeta(ramdisk).new_incoming_dir(), "shard")
    with open(written, "wb") as f:
        f.write(os.urandom(size))
    meta = ShardMeta(
        step=step,
        members=(group, group + 1),
        parity=1,
        stream_bytes=(size, size),
        stripe=stripe,
        index=0,
        bytes=size,
        crc32c="00000000",
        basis="0" * 64,
    )
    ParityShards(ramdisk).install(written, meta)


def test_pressure_gives_up_parity_shards_of_a_step_before_its_replicas_and_its_own_copy(ramdisk, tmp_path):
    disk = Ramdisk(NS, JOB, 12 * MiB, ramdisk)
    meta = JobMeta(ramdisk)
    for step in (1, 2, 3):
        commit_own_step(meta, step, 0, {"a": os.urandom(MiB)})
    _replica(meta, tmp_path, 1, 2, MiB)
    for step, stripe in ((1, 0), (2, 0), (2, 1)):
        _shard(ramdisk, step, 4, stripe, MiB // 2)
    order = RetainOrder(NS, JOB, keep_from=1, protected=())
    assert "parity shards 1572864" in space.describe_use(disk)

    # Step 1 is safe: its shard is kept. Of step 2: its shards, then the replica, then the own step. 3 is the newest.
    given = space.make_room(disk, order, set(), space.free_bytes(ramdisk) + 8 * MiB)
    assert [(g.kind, g.rank, g.step, g.stripe) for g in given] == [
        (Copy.PARITY, 4, 2, 0),
        (Copy.PARITY, 4, 2, 1),
        (Copy.REPLICA, 1, 2, 0),
        (Copy.OWN, 0, 2, 0),
    ]
    assert [(m.step, m.stripe) for m in ParityShards(ramdisk).held()] == [(1, 0)]
    assert given[0].what == "the parity shard (stripe 0) of rank 4's group for"
    # Only as much as is needed: a shard may be all it takes.
    _shard(ramdisk, 3, 4, 0, MiB // 2)
    commit_own_step(meta, 4, 0, {"a": os.urandom(MiB)})
    given = space.make_room(disk, order, set(), space.free_bytes(ramdisk) + MiB // 4)
    assert [(g.kind, g.step) for g in given] == [(Copy.PARITY, 3)]


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
    assert [(g.rank, g.step, g.kind) for g in given] == [(1, 2, Copy.REPLICA), (0, 2, Copy.OWN), (0, 3, Copy.OWN)]
    assert sorted(meta.replicas()) == [(1, 3)]
    # An order asked for after it judges it like any other copy.
    assert [(g.rank, g.step) for g in space.make_room(disk, order, set(), everything, order_asked_at=asked + 2)] == [
        (1, 3)
    ]
