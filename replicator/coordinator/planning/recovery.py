"""What a restarted coordinator cannot learn again from reports, for restores and backups: the job's part of the
state dir (``recovery_snapshot`` writes and reads the file).

Everything else is rebuilt from the agents' next reports. These are not, or not in time:

- a lost rank's checksums (``OwnerReports``): its node never reports again, and a decode of the rank is verified
  against them, and its group's shards count only over them (``parity``). Kept for the steps some encode order is
  of, for every rank that has them;
- the encode orders (``parity_orders.ParityOrders``): a shard counts only where the coordinator ordered it, and a
  restarted one cannot order a lost member's group's step again without the lost member's checksums;
- the backup in progress and the schedule (``backups``): the step chosen, its upload tag (``JobState.backup_attempt``:
  a new tag would upload every rank again and never commit what is in flight), when it was chosen, the last
  backup's time, when each backup was first seen complete and each safe step first found safe (``backups.lag``),
  and the steps written again (never backed up);
- the evidence a data-parallel peer may stand in for a rank stranded in the backup in progress
  (``backups.stand_ins``): that rank's checksums and signature of the step, which its lost node never reports again.

A snapshot is the coordinator's own word, written by it: checksums kept still lose to the rank's own node's report
(``OwnerReports.promote``), and a shard still counts only over the members' current checksums.
"""

import zlib
from typing import Annotated

import msgspec

from replicator.coordinator.copies import backups
from replicator.coordinator.indices.job import JobState, unpack_files
from replicator.coordinator.indices.parity_orders import ShardSlot
from replicator.wire.messages import JobRef, Name, Rank, Step

_Seconds = Annotated[float, msgspec.Meta(ge=0)]


class RecoveredChecksums(msgspec.Struct, frozen=True, gc=False):
    """A rank's checksums of a step, as ``job.pack_files`` packs them (base64 in JSON)."""

    step: Step
    rank: Rank
    files: bytes


class RecoveredOrder(msgspec.Struct, frozen=True, gc=False):
    """An encode order: ``node`` builds ``slot`` over ``basis`` (``redundancy.basis``, 64 hex digits)."""

    node: Name
    slot: ShardSlot
    basis: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class RecoveredBackup(msgspec.Struct, frozen=True, gc=False):
    """The job's backup state (``JobState``'s fields of the same meaning; times in unix seconds). ``signatures``: the
    pending step's signatures of its stranded ranks (``backups.stranded_ranks``), whose checksums are kept too."""

    pending: Step | None
    pending_since: _Seconds
    attempt: Annotated[str, msgspec.Meta(max_length=128)]
    last_time: _Seconds | None
    seen: dict[Step, _Seconds]
    safe_at: dict[Step, _Seconds]
    rewritten: list[Step]
    last_chosen: _Seconds | None = None
    signatures: dict[Rank, Annotated[str, msgspec.Meta(max_length=128)]] = {}


class JobRecovery(msgspec.Struct, frozen=True, gc=False):
    """One job's part of the state dir."""

    namespace: Name
    job: Name
    checksums: list[RecoveredChecksums]
    orders: list[RecoveredOrder]
    backup: RecoveredBackup


def stamp(job: JobState) -> tuple[object, ...]:
    """Changes whenever what ``record`` would keep of the job may have changed; cheap (no walk of the ranks)."""
    return (
        job.parity_orders.stamp,
        tuple(
            job.owners.step_stamps.get(step) for step in sorted(job.parity_orders.steps())
        ),  # not every step's: saves stream in
        job.backup_pending,
        job.backup_pending_since,
        job.backup_attempt,
        job.last_backup_time,
        job.last_backup_chosen_at,
        tuple(job.backup_seen.items()),
        tuple(job.safe_at.items()),
        tuple(sorted(job.rewritten)),
        _stranded(job),
    )


def _stranded(job: JobState) -> tuple[int, ...]:
    """The ranks of the backup in progress whose node holds no copy of its step (memoized by ``stranded_ranks``)."""
    return backups.stranded_ranks(job, job.backup_pending) if job.backup_pending is not None else ()


def steps(job: JobState) -> frozenset[int]:
    """The steps of what is kept: a restarted coordinator keeps them while its first reports arrive (a step held
    only by a node that has not reported yet is not gone)."""
    return job.parity_orders.steps() | {step for step, _ in job.owners.recovered}


def record(key: JobRef, job: JobState) -> JobRecovery | None:
    """What to keep of the job, or None when there is nothing."""
    ordered = job.parity_orders.steps()
    pending = job.backup_pending
    stranded = {(pending, rank) for rank in _stranded(job)} if pending is not None else set()
    checksums = [
        RecoveredChecksums(step, rank, packed)
        for step, rank in sorted({*job.owners.files, *job.owners.recovered})
        if (step in ordered or (step, rank) in stranded) and (packed := job.owners.known(step, rank)) is not None
    ]
    orders = [
        RecoveredOrder(node, slot, basis)
        for node, mine in sorted(job.parity_orders.ordered.items())
        for slot, basis in mine.items()
    ]
    backup = RecoveredBackup(
        job.backup_pending,
        job.backup_pending_since,
        job.backup_attempt,
        job.last_backup_time,
        dict(job.backup_seen),
        dict(job.safe_at),
        sorted(job.rewritten),
        job.last_backup_chosen_at,
        {
            rank: signature
            for step, rank in sorted(stranded)
            if (signature := job.identity.signatures.get((step, rank))) is not None
        },
    )
    if not checksums and not orders and backup == RecoveredBackup(None, 0.0, "", None, {}, {}, []):
        return None
    return JobRecovery(key.namespace, key.job, checksums, orders, backup)


def check(recovered: JobRecovery) -> None:
    """Unpacks every checksum kept, so that a damaged one fails the load, not a restore.

    Raises:
      ValueError: one does not unpack.
    """
    for checksums in recovered.checksums:
        try:
            unpack_files(checksums.files)
        except zlib.error as err:  # msgspec's errors are ValueErrors already
            raise ValueError(f"checksums of rank {checksums.rank} step {checksums.step}: {err}") from None


def apply(job: JobState, recovered: JobRecovery) -> None:
    """Takes in what a previous coordinator kept (``check``ed), before any report of the job arrives."""
    for checksums in recovered.checksums:
        job.owners.recover(checksums.step, checksums.rank, checksums.files)
    for order in recovered.orders:
        job.parity_orders.order(order.node, [order.slot], order.basis)
    backup = recovered.backup
    job.backup_pending, job.backup_pending_since, job.backup_attempt = (
        backup.pending,
        backup.pending_since,
        backup.attempt,
    )
    job.last_backup_time, job.last_backup_chosen_at = backup.last_time, backup.last_chosen
    job.backup_seen, job.safe_at, job.rewritten = dict(backup.seen), dict(backup.safe_at), set(backup.rewritten)
    if backup.pending is not None:
        for rank, signature in backup.signatures.items():
            job.identity.add_signature(backup.pending, rank, signature)
    job.decided.dirty = True
