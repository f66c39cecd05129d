"""The operator's rollback (``mtc restore-from``): its preview, its request and its cancellation.

A request only records the step (``JobState.forced_step``); nothing is abandoned until the job's
restore is planned, when ``restores.begin_rollback`` begins the new timeline. Until then retention
orders nothing (``retention.retain_order``), backup retention keeps the requested step
(``backups.orders``), and a cancel leaves the job as if the rollback had never been asked for.
"""

import logging

from replicator.coordinator import planner
from replicator.coordinator.copies import retention
from replicator.coordinator.indices.job import JobState
from replicator.wire.messages import JobRef
from replicator.wire.operator import AbandonedStep, RollbackPreview

log = logging.getLogger(__name__)


class NotCancellable(Exception):
    """The job has no rollback that can still be cancelled (none pending, or its restore is planned)."""


def check_restorable(key: JobRef, job: JobState, step: int, copies: list[planner.StepCopy]) -> None:
    """Raises LookupError unless ``copies`` (believed copies and complete backups), less those the
    current incarnation's restore proved unusable, hold ``step`` for every rank."""
    ranks = job.ranks()
    unusable = job.incarnation.excluded if job.incarnation is not None else set()
    if not ranks or {c.rank for c in copies if c.step == step and (c.step, c.rank, c.holder) not in unusable} != set(
        range(ranks)
    ):
        raise LookupError(
            f"step {step} of {key} is not complete for every rank in any tier"
            f"{' (copies of it were found unusable)' if any(u[0] == step for u in unusable) else ''}"
        )


def preview(
    key: JobRef, job: JobState, step: int, copies: list[planner.StepCopy], backed_up: set[int]
) -> RollbackPreview:
    """What a rollback to ``step`` would abandon: every copy (believed or not) and complete backup of
    the job's lineage newer than ``step``.

    Args:
      copies: the believed copies and complete backups (``step`` must be complete in them).
      backed_up: the complete backups of the job's lineage.

    Raises:
      LookupError: no tier holds ``step`` complete for every rank.
    """
    check_restorable(key, job, step, copies)
    local: dict[int, dict[int, list[str]]] = {}
    peer: dict[int, dict[int, list[str]]] = {}
    for (held, rank), holders in job.claims.holders.items():
        if held > step:
            for node_id, replica in holders.items():
                (peer if replica else local).setdefault(held, {}).setdefault(rank, []).append(node_id)
    newer = sorted(set(local) | set(peer) | {s for s in backed_up if s > step})

    def by_rank(table: dict[int, list[str]]) -> dict[int, tuple[str, ...]]:
        return {rank: tuple(sorted(nodes)) for rank, nodes in sorted(table.items())}

    abandoned = tuple(
        AbandonedStep(s, by_rank(local.get(s, {})), by_rank(peer.get(s, {})), s in backed_up) for s in newer
    )
    return RollbackPreview(
        key.namespace, key.job, step, job.ranks(), abandoned, len(job.forks) + 1, job.pending_rollback()
    )


def request(key: JobRef, job: JobState, step: int, copies: list[planner.StepCopy]) -> None:
    """Records the rollback to ``step`` (replacing a pending one) and withdraws the job's retain order.

    Raises:
      LookupError: ``copies`` do not hold ``step`` for every rank.
    """
    check_restorable(key, job, step, copies)
    job.forced_step, job.forked = step, False
    _retain_now(key, job)
    log.warning("job %s: the next restore will use step %d (operator request)", key, step)


def cancel(key: JobRef, job: JobState) -> int:
    """Withdraws the pending rollback: the job's next restore takes its newest step again, and its
    retain order is given again.

    Returns:
      The step the rollback was to.

    Raises:
      NotCancellable: none is pending, or its restore is already planned (the new timeline began and
        the newer steps are abandoned: only another rollback can change the step now).
    """
    if job.forced_step is None:
        last = f"; the last rollback, to step {job.forks[-1]}, began timeline {len(job.forks)}" if job.forks else ""
        raise NotCancellable(f"job {key} has no pending rollback{last}")
    if job.forked:
        raise NotCancellable(
            f"the rollback of job {key} to step {job.forced_step} cannot be cancelled: its restore is planned "
            f"and timeline {len(job.forks)} began (newer steps are abandoned)"
        )
    step, job.forced_step = job.forced_step, None
    _retain_now(key, job)
    log.warning("job %s: the rollback to step %d was cancelled (operator request)", key, step)
    return step


def _retain_now(key: JobRef, job: JobState) -> None:
    # At once, not at the next decision pass: no standing order may outlive a request that withdraws it.
    job.decided.retain = retention.retain_order(key, job)
