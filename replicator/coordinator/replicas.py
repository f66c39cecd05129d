"""Replication for data parallelism 1: each rank's replica targets, chosen once per incarnation, and
the orders that push a node's newest own step to them."""

from replicator.coordinator import planner
from replicator.coordinator.job import JobState
from replicator.coordinator.liveness import Liveness, NodeState
from replicator.wire.messages import JobRef, ReplicateOrder, Target


def wanted(job: JobState, liveness: Liveness) -> int:
    """The fewest replicas any node of the incarnation is configured for (``--replicas``);
    recomputed only after a node reported another setting (it visits every node)."""
    memo = job.memo
    if memo.replicas_for != (job.incarnation.incarnation_id, liveness.replicas_epoch):
        reports = [liveness.nodes[n].report for n in job.incarnation.nodes if n in liveness.nodes]
        memo.replicas_for, memo.replicas = (job.incarnation.incarnation_id, liveness.replicas_epoch), min((r.replicas for r in reports), default=1)
    return memo.replicas


def place(job: JobState, liveness: Liveness, replicas: int) -> None:
    """Chooses the incarnation's replica targets once per (incarnation, replicas): placement only,
    stable across steps. Without data parallelism the targets become believed holders."""
    chosen_for = (job.incarnation.incarnation_id, replicas)
    node_of_rank = job.incarnation.node_of_rank
    if job.memo.targets_for != chosen_for:
        job.memo.targets_for, job.decided.targets = chosen_for, planner.replica_targets(node_of_rank, liveness.blocks(node_of_rank.values()), replicas)
    if job.settings and job.identity.data_parallelism == 1 and job.memo.ordered_for != chosen_for:
        job.memo.ordered_for = chosen_for
        job.beliefs.order(job.decided.targets)


def orders(key: JobRef, job: JobState, state: NodeState, liveness: Liveness) -> list[ReplicateOrder]:
    """For data parallelism 1: push this node's newest own step to its rank's replica targets."""
    incarnation = job.incarnation
    if incarnation is None or not job.settings or job.identity.data_parallelism > 1:
        return []
    node_id = state.report.node_id
    newest: dict[int, int] = {}
    for claim in state.claims:
        if claim.job == key and not claim.replica and incarnation.node_of_rank.get(claim.rank) == node_id:
            newest[claim.rank] = max(newest.get(claim.rank, -1), claim.step)
    result = []
    for rank, step in newest.items():
        holders = job.claims.of(step, rank)
        missing = [t for t in job.decided.targets.get(rank, ()) if t not in holders and liveness.is_live(t)]
        if missing:
            result.append(ReplicateOrder(key.namespace, key.job, rank, step, tuple(Target(t, liveness.nodes[t].report.url) for t in missing)))
    return result
