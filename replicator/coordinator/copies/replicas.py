"""Replication for data parallelism 1: each rank's replica targets, chosen once per incarnation, and replication
in rounds: every rank pushes the same step, the round's, until it is safe.

Why rounds: a step is safe (GC may keep from it, a lost node restores it) only once every rank's copy of it is
replicated. When each rank pushed its own newest step as its push lane freed, ranks saving out of phase with their
pushes replicated different steps, and no step had replicas of every rank for minutes.

The rule (``choose_round``, each decision pass): the round is the newest step that every rank's own node holds and
that is newer than the safe step; it stays the round until it is safe, the incarnation ends, or a rank's node no
longer holds it. Orders (``orders``) push only the round's step.

Bound, sketched: let P be the longest push of one rank's step and L the coordinator's latency (a report, a pass). A
round starts at most L after its step is held by every rank. A node's push lane may still carry one push of the
previous round (at most P), then carries this one (at most P); GC keeps every step newer than the safe step, so the
round's step stays held. So the round is safe within 2P + 2L of its start, and the next round starts from the
newest step every rank holds by then: the safe step trails the newest complete step by at most about 2P + 2L plus
one save interval, whatever the save rate.
"""

from replicator.coordinator import planner
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.indices.liveness import Liveness, NodeState
from replicator.wire.messages import JobRef, ReplicateOrder, Target


def wanted(job: JobState, liveness: Liveness) -> int:
    """The fewest replicas any node of the incarnation is configured for (``--replicas``);
    recomputed only after a node reported another setting (it visits every node)."""
    memo = job.memo
    assert job.incarnation is not None  # decided only for a job with an incarnation
    if memo.replicas_for != (job.incarnation.incarnation_id, liveness.replicas_epoch):
        reports = [liveness.nodes[n].report for n in job.incarnation.nodes if n in liveness.nodes]
        memo.replicas_for, memo.replicas = (
            (job.incarnation.incarnation_id, liveness.replicas_epoch),
            min((r.replicas for r in reports), default=1),
        )
    return memo.replicas


def place(job: JobState, liveness: Liveness, replicas: int) -> None:
    """Chooses the incarnation's replica targets once per (incarnation, replicas): placement only,
    stable across steps. Without data parallelism the targets become believed holders."""
    assert job.incarnation is not None  # decided only for a job with an incarnation
    chosen_for = (job.incarnation.incarnation_id, replicas)
    node_of_rank = job.incarnation.node_of_rank
    if job.memo.targets_for != chosen_for:
        job.memo.targets_for, job.decided.targets = (
            chosen_for,
            planner.replica_targets(node_of_rank, liveness.blocks(node_of_rank.values()), replicas),
        )
    if job.settings and job.identity.data_parallelism == 1 and job.memo.ordered_for != chosen_for:
        job.memo.ordered_for = chosen_for
        job.beliefs.order(job.decided.targets)


def choose_round(job: JobState, safe: int | None, encoded: list[int] | None = None) -> int | None:
    """The step every rank replicates now (see the module docstring), or None: data parallelism above 1 with
    full replicas, no settings yet, or no step newer than ``safe`` held by every rank's own node.

    Args:
      encoded: under parity redundancy, the encoded ranks (``parity.encoded_ranks``): the round is a step their
        own nodes all hold, whatever the data parallelism; None for full replicas.
    """
    incarnation = job.incarnation
    if incarnation is None or not job.settings or (encoded is None and job.identity.data_parallelism > 1):
        return None
    node_of_rank = incarnation.node_of_rank
    if encoded is not None:
        node_of_rank = {r: node_of_rank[r] for r in encoded if r in node_of_rank}
        if not node_of_rank:
            return None

    def held_by_every_rank(step: int) -> bool:
        return all(job.claims.of(step, rank).get(node) is False for rank, node in node_of_rank.items())

    current = job.decided.round if job.memo.round_for == incarnation.incarnation_id else None
    job.memo.round_for = incarnation.incarnation_id
    if current is not None and (safe is None or current > safe) and held_by_every_rank(current):
        return current
    for step in sorted(job.claims.step_ranks, reverse=True):
        if safe is not None and step <= safe:
            break
        if held_by_every_rank(step):
            return step
    return None


def orders(key: JobRef, job: JobState, state: NodeState, liveness: Liveness) -> list[ReplicateOrder]:
    """For data parallelism 1: push the round's step of each rank this node holds to the rank's replica targets."""
    step = job.decided.round
    if step is None or job.incarnation is None:
        return []
    node_id = state.report.node_id
    rank = job.incarnation.rank_of_node.get(node_id)  # one training pod per node and job
    if rank is None or (holders := job.claims.of(step, rank)).get(node_id) is not False:
        return []
    missing = [t for t in job.decided.targets.get(rank, ()) if t not in holders and liveness.is_live(t)]
    if not missing:
        return []
    return [
        ReplicateOrder(
            key.namespace, key.job, rank, step, tuple(Target(t, liveness.nodes[t].report.url) for t in missing)
        )
    ]
