"""Lineage: a job's rollbacks (``messages.in_lineage``). When its timeline moves on (an operator's
rollback, or a node reports one this coordinator missed) the copies, checksums, signatures and
backups of abandoned timelines are forgotten."""

import logging

from replicator.coordinator.indices.job import JobState
from replicator.coordinator.indices.liveness import NodeState
from replicator.wire.messages import JobRef, NodeReport, extends, in_lineage

log = logging.getLogger(__name__)


def news(report: NodeReport, jobs: dict[JobRef, JobState]) -> bool:
    """Whether the report names rollbacks of a known job that its coordinator has not adopted."""
    return any(
        (job := jobs.get(JobRef(lineage.namespace, lineage.job))) is not None and extends(lineage.forks, job.forks)
        for lineage in report.lineages
    )


def set_lineage(key: JobRef, job: JobState, forks: tuple[int, ...], nodes: dict[str, NodeState]) -> None:
    """Moves the job to ``forks`` (which extends its own): the nodes' claims of abandoned copies are
    dropped, with the tables' entries of steps above the lowest new rollback point. The caller
    bumps the job's version."""
    lowest = min(forks[len(job.forks) :])  # steps above the lowest new rollback point may be abandoned
    job.forks = forks
    job.decided.safe = job.decided.retain = None  # the safe step may be abandoned: GC waits for the next decision pass
    for node_id, state in nodes.items():
        gone = {c for c in state.claims if c.job == key and not in_lineage(forks, c.step, c.timeline)}
        if gone:
            state.claims = state.claims - gone
        for claim in gone:
            job.drop_claim(claim.step, claim.rank, node_id)
    # Until now only steps of the older lineage were indexed: above ``lowest`` they are all abandoned.
    job.owners.forget_above(lowest)
    job.identity.forget_above(lowest)
    job.parity_orders.forget_steps(lambda step: step <= lowest)
    job.rewritten = {s for s in job.rewritten if s <= lowest}
    if job.backup_pending is not None and job.backup_pending > lowest:
        job.backup_pending = None
    job.decided.dirty = True
    log.warning(
        "job %s: timeline %d begins at step %d; copies of newer steps of older timelines are abandoned",
        key,
        len(forks),
        forks[-1],
    )
