"""Safety and retention: the newest step GC may keep from, and the order that says so."""

from collections.abc import Callable, Iterable

from replicator.coordinator import planner
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.indices.liveness import Liveness
from replicator.wire.messages import JobRef, RetainOrder


def safe_step(
    job: JobState,
    liveness: Liveness,
    replicas: int,
    backed_up: set[int],
    live_copies: Callable[[], list[planner.StepCopy]],
    encoded_safe: Callable[[int], bool] | None = None,
) -> tuple[int | None, int]:
    """The newest step complete for every rank whose every rank's data also exists elsewhere: on a
    data-parallel peer established identical, or on the wanted number of holders, a complete backup
    of the lineage counting as one. GC may delete anything older. Live copies only: a silent
    node's copy may be gone, GC keeps more. A step of the shape before an elastic restore is never
    safe: the old shape's steps are kept whole until a step of the new shape is safe.

    Args:
      replicas: replicas wanted per rank; backed_up: complete backups of the lineage.
      live_copies: called for the believed copies on live nodes, only when a backed-up step needs one.
      encoded_safe: under parity redundancy, whether a step survives the setting's losses (``parity.safe``),
        in place of the replica count; a complete backup still makes a step safe.

    Returns:
      (the step or None, the ranks looked at one by one).
    """
    incarnation = job.incarnation
    assert incarnation is not None  # decided only for a job with an incarnation
    nodes = len(incarnation.node_of_rank)
    steps = _steps_of_the_shape(job, incarnation.plan)
    if encoded_safe is not None:
        return _newest_encoded_safe(steps, nodes, encoded_safe, backed_up, live_copies)
    if job.identity.data_parallelism > 1:
        return _newest_covered(job, liveness, steps, nodes)
    wanted = _holders_wanted(incarnation.nodes, liveness, replicas)
    return _newest_replicated(job, liveness, steps, nodes, wanted, backed_up, live_copies)


def _steps_of_the_shape(job: JobState, plan: planner.RestorePlan | None) -> list[int]:
    """The steps some node claims, newest first, down to the step the incarnation resharded from (excluded).

    After an elastic restore the steps up to the resharded one are the old shape's: none is safe in the
    new one, so GC deletes none of them before a step of the new shape is safe."""
    steps = sorted(job.claims.step_ranks, reverse=True)
    if plan is None or plan.saved_nodes is None or plan.step is None:
        return steps
    resharded = plan.step
    return [step for step in steps if step > resharded]


def _holders_wanted(job_nodes: Iterable[str], liveness: Liveness, replicas: int) -> int:
    """Holders wanted per rank: 1 + replicas, or fewer while fewer nodes of the job are live."""
    wanted = 0
    for node_id in job_nodes:
        wanted += liveness.is_live(node_id)
        if wanted > replicas:
            break
    return wanted


def _newest_encoded_safe(
    steps: list[int],
    nodes: int,
    encoded_safe: Callable[[int], bool],
    backed_up: set[int],
    live_copies: Callable[[], list[planner.StepCopy]],
) -> tuple[int | None, int]:
    """Under parity redundancy: the newest of ``steps`` that survives the setting's losses, or that is backed
    up and has a live copy; (the step or None, ranks looked at)."""
    checks = 0
    for step in steps:
        checks += nodes
        if encoded_safe(step) or (step in backed_up and any(c.step == step for c in live_copies())):
            return step, checks
    return None, checks


def _newest_covered(job: JobState, liveness: Liveness, steps: list[int], nodes: int) -> tuple[int | None, int]:
    """Data-parallel: the newest of ``steps`` whose every rank was found identical on a peer, every rank held
    on a live node; (the step or None, ranks looked at)."""
    covered, checks = job.identity.covered, 0
    for step in steps:
        if len(covered.get(step, ())) >= nodes and covered[step].issuperset(range(nodes)):
            held, walked = _every_rank_held(job, liveness, step, nodes, 1)
            checks += walked
            if held:
                return step, checks
    return None, checks


def _newest_replicated(
    job: JobState,
    liveness: Liveness,
    steps: list[int],
    nodes: int,
    wanted: int,
    backed_up: set[int],
    live_copies: Callable[[], list[planner.StepCopy]],
) -> tuple[int | None, int]:
    """Replicas: the newest of ``steps`` whose every rank has ``wanted`` live holders, a complete backup
    counting as one; (the step or None, ranks looked at)."""
    checks = 0
    for step in steps:
        # A complete backup counts as one holder: a replica in flight does not hold GC back, and
        # a corrupt backup object alone never leaves a rank with a single copy.
        need = wanted - (step in backed_up)
        if need <= 0:
            if any(c.step == step for c in live_copies()):
                return step, checks  # at most one live node: any live copy of a backed-up step will do
        else:
            held, walked = _every_rank_held(job, liveness, step, nodes, need)
            checks += walked
            if held:
                return step, checks
    return None, checks


def _every_rank_held(job: JobState, liveness: Liveness, step: int, nodes: int, wanted: int) -> tuple[bool, int]:
    return job.memo.held.every_rank_held(
        job.claims, job.beliefs, liveness.nodes, liveness.stamp, step, nodes, wanted, True
    )


def retain_order(key: JobRef, job: JobState) -> RetainOrder | None:
    """Keep from the safe step, protecting the step being backed up, the step being restored (until every
    rank staged it and a step newer than it and than any step the restore passed over is safe) and the
    replication round's step (a node under pressure gives up only unsafe steps no order protects);
    None while nothing is safe or a rollback is pending (any step up to it may be needed)."""
    if job.decided.safe is None or (job.forced_step is not None and not job.forked):
        return None
    incarnation = job.incarnation
    protected = {job.backup_pending} if job.backup_pending is not None else set()
    if incarnation and incarnation.plan and incarnation.plan.step is not None:
        # Until every rank staged it and a newer step is safe: after that no rank of the incarnation
        # restores it, and its copies would hold a ramdisk sized by the rule past what it has. A step the restore
        # passed over (a copy of it proven unusable) may still count as safe; it is no newer step to restore.
        newest_passed = max((step for step, _, _ in incarnation.excluded), default=incarnation.plan.step)
        restored = len(incarnation.staged) == len(incarnation.node_of_rank) and job.decided.safe > max(
            incarnation.plan.step, newest_passed
        )
        if not restored:
            protected.add(incarnation.plan.step)
    if job.decided.round is not None:
        protected.add(job.decided.round)
    return RetainOrder(key.namespace, key.job, job.decided.safe, tuple(sorted(protected)))


def newest_complete(job: JobState, liveness: Liveness, backups: set[int]) -> tuple[int | None, int]:
    """The newest step held, in ``backups`` or on nodes not given up, for every rank of the job.

    Returns:
      (the step or None, the ranks looked at one by one).
    """
    nodes, checks = job.ranks(), 0
    if not nodes:
        return None, 0
    for step in sorted(backups.union(job.claims.step_ranks), reverse=True):
        if step in backups:
            return step, checks
        held, walked = job.memo.held.every_rank_held(
            job.claims, job.beliefs, liveness.nodes, liveness.stamp, step, nodes, 1, False
        )
        checks += walked
        if held:
            return step, checks
    return None, checks


def copies(job: JobState, liveness: Liveness, live_only: bool) -> list[planner.StepCopy]:
    """Every believed copy of the job's steps on nodes live (``live_only``: what safety and GC may
    count on) or not given up (restore sources)."""
    # is_live / holds_data and ``Beliefs.believed``, inlined: a 10,000-rank job has 30,000 claims and more per pass.
    limit = liveness.node_timeout_seconds if live_only else liveness.holder_grace_seconds
    now, nodes = liveness.now, liveness.nodes
    rank_nodes, ordered, kept = job.beliefs.rank_nodes, job.beliefs.ordered, job.beliefs.kept
    return [
        planner.StepCopy(step, rank, node_id)
        for (step, rank), holders in job.claims.holders.items()
        for node_id, replica in holders.items()
        if (state := nodes.get(node_id)) is not None
        and now - state.last_seen <= limit
        and (
            node_id in rank_nodes.get(rank, ())
            or (replica and (rank, node_id) in ordered)
            or (kept and node_id in kept.get((step, rank), ()))
        )
    ]
