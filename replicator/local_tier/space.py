"""Space on a job's ramdisk: what the job's next save needs, and giving up unsafe copies to make room.

A ramdisk holds the job's own steps, other ranks' replicas, replicas being received and a restore's
staging. Our copies must never take the space of the job's own next save:

- a replica receive starts only if the job's next save still fits beside it (``next_save_bytes``;
  the peer service refuses it with 507 otherwise, and the push is tried again later);
- a restore staging starts only if it fits;
- when less than the next save is free, copies of steps newer than the newest safe step are given up,
  oldest first, and of one step its parity shards, then other ranks' replicas, then the node's own step
  (``make_room``: a shard only adds redundancy to other ranks' copies, a replica is another rank's second
  copy, the own step may be the rank's only one), but never the safe step's (so no rank loses its last restorable
  copy), never a step the coordinator protects (the replication round's, the one being restored,
  the one being backed up), never the job's newest committed step (about to become safe, and
  the one a restore of every node would pick), and never a replica that arrived after the node asked
  for the order (sent the report it answered): the coordinator orders the round's push before this
  node's next reply names the round, and a replica given up on arrival left the round unsafe until
  it was pushed again. While
  nothing is safe or a rollback is pending (no retain order), nothing is given up: any step may be
  the one restored.

What a ramdisk must hold, then (``shards_needed``, docs/operations.md, Sizing).
"""

import contextlib
import dataclasses
import enum
import os

from prometheus_client import Counter

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.parity_shards import ParityShards
from replicator.local_tier.steps import delete_step
from replicator.wire.messages import RetainOrder

GIVEN_UP = Counter("mtc_copies_given_up_total", "Unsafe copies deleted to keep room for the job's next save")

# The next save is taken as the newest own save's bytes plus this share: tmpfs rounds every file up
# to a page, and a save writes metadata beside its arrays.
SAVE_MARGIN = 0.1
# Below 1 % of its size free (at least a page) a ramdisk counts as full: a save cannot go on.
_PAGE = 4096


# Kept allocated in the agent's area of every ramdisk, and deleted just before the agent tells the job
# its ramdisk is full: a report needs a few pages, and a full ramdisk has none.
RESERVE_BYTES = 16 << 10
_RESERVE = "space-reserve"


def keep_reserve(meta: JobMeta) -> None:
    """Creates the reserve (``RESERVE_BYTES`` of pages) when it is missing and fits."""
    path = os.path.join(meta.root, _RESERVE)
    if os.path.exists(path) or free_bytes(meta.root) < 2 * RESERVE_BYTES:
        return
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(bytes(RESERVE_BYTES))  # written, not truncated: tmpfs allocates pages only as they are written
        os.replace(path + ".tmp", path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path + ".tmp")


def release_reserve(meta: JobMeta) -> None:
    """Deletes the reserve, freeing its pages for a report to the job."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(meta.root, _RESERVE))


def free_bytes(path: str) -> int:
    """Bytes still free on the filesystem of ``path`` for an unprivileged writer."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def is_full(path: str) -> bool:
    """True when the filesystem of ``path`` has less than 1 % of its size (or a page) free."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize < max(_PAGE, stats.f_blocks * stats.f_frsize // 100)


def shards_needed(data_parallelism: int, replicas: int) -> int:
    """How many shards (one rank's save) a ramdisk must hold, by the sizing rule; add ``SAVE_MARGIN``.

    Data parallelism 2 or more: the newest safe step and the save in flight (a step is safe once its
    data-parallel peer reported the same checksums, a report round after the save). Data parallelism 1
    with ``replicas`` replicas per step: the safe step and the replicas this node hosts of it, the
    replication round's step and the replicas it receives of it, the newest save, the save in flight, and
    one more save: a replica is received only with a whole next save free beside it, and while the job
    writes a save that room is counted again (a ramdisk of 2r + 4 refused the round's replica for 23 s
    at a time while the job saved every step).
    """
    return 2 if data_parallelism > 1 else 2 * replicas + 5


def next_save_bytes(meta: JobMeta) -> int:
    """Bytes the job's next save is expected to need: its newest committed step's bytes plus
    ``SAVE_MARGIN``; 0 before its first save."""
    manifests = meta.manifests()
    return int(manifests[max(manifests)].total_bytes * (1 + SAVE_MARGIN)) if manifests else 0


class Copy(enum.IntEnum):
    """What ``make_room`` gives up, in the order it does so within a step."""

    PARITY = 0  # a parity shard this node built over its group's step
    REPLICA = 1  # another rank's replica
    OWN = 2  # the node's own step


@dataclasses.dataclass(frozen=True)
class GivenUp:
    """A copy ``make_room`` deleted: ``rank``'s ``step`` (for a parity shard: its group's first rank, and the shard's
    ``stripe``), ``bytes`` of it."""

    rank: int
    step: int
    bytes: int
    kind: Copy
    stripe: int = 0

    @property
    def what(self) -> str:
        """Whose copy it is, for a log line ("gave up <what> step S")."""
        if self.kind is Copy.OWN:
            return "its own"
        if self.kind is Copy.REPLICA:
            return f"rank {self.rank}'s replica of"
        return f"the parity shard (stripe {self.stripe}) of rank {self.rank}'s group for"


def make_room(
    disk: Ramdisk, order: RetainOrder | None, busy: set[int], need: int, order_asked_at: float | None = None
) -> list[GivenUp]:
    """Gives up unsafe copies, oldest step first (replicas before own steps of the same step), until
    ``need`` bytes are free or none is left to give up (see the module docstring for what is kept).

    Args:
      disk: the job's ramdisk.
      order: the coordinator's latest retain order for the job (its ``keep_from`` is the newest safe
        step), or None: nothing is given up.
      busy: steps being read (a push, an upload): kept.
      need: bytes wanted free.
      order_asked_at: when the node sent the report ``order`` answered (wall-clock seconds): replicas
        installed since are kept. None: the order is not the coordinator's, and no replica is kept for this.

    Returns:
      The copies deleted, in order.
    """
    if order is None or free_bytes(disk.path) >= need:
        return []
    meta = JobMeta(disk.path)
    manifests = meta.manifests()
    keep = set(order.protected) | busy | ({max(manifests)} if manifests else set())
    shards = ParityShards(disk.path)
    candidates = [GivenUp(m.rank, step, m.total_bytes, Copy.OWN) for step, m in manifests.items()]
    candidates += [GivenUp(rank, step, m.total_bytes, Copy.REPLICA) for (rank, step), m in meta.replicas().items()]
    candidates += [GivenUp(s.members[0], s.step, s.bytes, Copy.PARITY, s.stripe) for s in shards.held()]
    given: list[GivenUp] = []
    for copy in sorted(candidates, key=lambda c: (c.step, c.kind, c.rank, c.stripe)):
        if free_bytes(disk.path) >= need:
            break
        if copy.step <= order.keep_from or copy.step in keep:
            continue
        if (
            copy.kind is Copy.REPLICA
            and order_asked_at is not None
            and (meta.replica_installed_at(copy.rank, copy.step) or 0.0) >= order_asked_at
        ):
            continue  # perhaps the round's, which the order predates
        if copy.kind is Copy.OWN:
            meta.drop_manifest(copy.step)  # first: a step is never reported once its deletion began
            delete_step(meta.framework, disk.client_dir, copy.step)
        elif copy.kind is Copy.REPLICA:
            meta.drop_replica(copy.rank, copy.step)
        else:
            shards.drop(copy.step, copy.rank, copy.stripe)
        given.append(copy)
    return given


def describe_use(disk: Ramdisk) -> str:
    """One line on what fills the ramdisk: its size, our copies and the job's other files, in bytes."""
    meta = JobMeta(disk.path)
    stats = os.statvfs(disk.path)
    size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    own = sum(m.total_bytes for m in meta.manifests().values())
    replicas = sum(m.total_bytes for m in meta.replicas().values())
    parity = ParityShards(disk.path).total_bytes()
    return (
        f"the ramdisk holds {size} bytes, {free} free: committed steps {own}, other ranks' replicas {replicas},"
        f" parity shards {parity}, the rest ({max(0, size - free - own - replicas - parity)}) is being written by"
        " the job or received"
    )
