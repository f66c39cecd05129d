"""Restore planning: each incarnation's frozen plan (``planner.plan_restore`` over the believed
copies not proven unusable), its replans, the operator's rollback, and each rank's view of it.

The façade (``ClusterState``) decides when to plan and bumps the job's version; these functions
take the job and what they read explicitly.
"""

import dataclasses
import enum
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import cast

from replicator.coordinator import planner
from replicator.coordinator.copies import backups
from replicator.coordinator.indices.incarnations import Incarnation
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.indices.liveness import Liveness, NodeState
from replicator.coordinator.indices.sync import WarnedOnce
from replicator.coordinator.planning import parity
from replicator.wire.messages import BadCopy, Files, JobRef, RestoreView, Source, Tier

log = logging.getLogger(__name__)

# Tiers whose restore path exists in this release; the planner already knows the others.
USABLE_TIERS = frozenset(Tier)
# A rank's restore view lists at most this many peer copies (live holders first), besides its own
# and the backup: each carries the step's checksums, and a rank of a 40-slice job has 39 identical
# peers. A peer proven bad is excluded and the replan lists the next ones.
PEER_SOURCES_PER_VIEW = 4
_PEER_TIERS = frozenset({Tier.PEER_CLOSE, Tier.PEER_DISTANT})
_NO_NODE_TIERS = frozenset({Tier.BACKUP, Tier.DECODE})  # no one node holds the copy: never silent


class NotReady(Exception):
    """The answer depends on reports that have not arrived yet; ask again shortly."""


def check_started(incarnation: Incarnation, liveness: Liveness, now: float) -> None:
    """Raises ``NotReady`` while the coordinator started less than a node timeout ago and the
    incarnation has no plan: a holder that has not reported yet would make it choose an older step."""
    if incarnation.plan is None and now - liveness.started < liveness.node_timeout_seconds:
        raise NotReady(f"the coordinator started {now - liveness.started:.0f} s ago; waiting for every node's report")


def check_plannable(
    job: JobState, incarnation: Incarnation, nodes: dict[str, NodeState], now: float, grace_seconds: float
) -> None:
    """Raises ``NotReady`` while the job's newest reports are undecided, or while its nodes (of
    ``nodes``) with a backup tier have not listed it, within ``grace_seconds`` of the incarnation:
    planning without it could start from scratch a job a backup would resume."""
    if job.decided.dirty:
        raise NotReady("the job's newest reports are being decided")
    backup_nodes = [n for n in incarnation.node_of_rank.values() if n in nodes and nodes[n].report.has_backup]
    if (
        backup_nodes
        and not any(n in job.listings for n in backup_nodes)
        and now - incarnation.created_at < grace_seconds
    ):
        raise NotReady(f"waiting for {job.decided.lister or 'a node with a backup tier'} to list the backup tier")


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a job's restore plan reads besides its incarnation, gathered by the façade.

    Attributes:
      copies: the job's believed copies, complete backups included (``ClusterState.copies``).
      blocks: called with node ids: node -> its topology block (``Liveness.blocks``).
      identical: the job's identical pairs (``Identity.pairs``).
      fan_out: a backup-only step is read once per identical group (``planner.plan_restore``).
      silent: the nodes silent past the node timeout (``planner.plan_restore``).
      shapes: the steps saved at another node count that the job can reshard (``elastic.saved_shapes``).
    """

    copies: list[planner.StepCopy]
    blocks: Callable[[set[str]], Mapping[str, str]]
    identical: Mapping[int, frozenset[tuple[int, int]]]
    fan_out: bool
    silent: frozenset[str]
    shapes: Mapping[int, int] = dataclasses.field(default_factory=dict)


def plan(incarnation: Incarnation, inputs: PlanInputs, forced: int | None) -> planner.RestorePlan:
    """The restore plan over the copies of ``inputs`` not proven unusable (only ``forced``'s, if given).

    The copies of lost holders (``lost_holders``) count only while no step can be restored without them: waiting
    out their grace period for nodes that may never come back would hold up a job that another step, an older one
    if need be, resumes at once.
    """
    excluded, lost = incarnation.excluded, lost_holders(incarnation, inputs.silent)
    usable = [
        c for c in inputs.copies if (c.step, c.rank, c.holder) not in excluded and (forced is None or c.step == forced)
    ]
    if any(c.holder in lost for c in usable):
        without = _plan_over(incarnation, inputs, [c for c in usable if c.holder not in lost])
        if without.step is not None:
            return without
    return _plan_over(incarnation, inputs, usable)


def lost_holders(incarnation: Incarnation, silent: Iterable[str]) -> frozenset[str]:
    """The ``silent`` nodes (past the node timeout) a restore does without while it can: those outside the
    incarnation (a lost node, its rank moved to a fresh one), unless a node of the incarnation is silent too. A
    silent node of the incarnation blocks the restore anyway (its own rank cannot stage without it), so waiting
    on the others then costs nothing, and its return may make their step restorable again (a decode needs its
    copy)."""
    silent = frozenset(silent)
    return frozenset() if silent & incarnation.nodes else silent - incarnation.nodes


def _plan_over(incarnation: Incarnation, inputs: PlanInputs, usable: list[planner.StepCopy]) -> planner.RestorePlan:
    node_of_rank = incarnation.node_of_rank
    block_of = inputs.blocks({c.holder for c in usable} | set(node_of_rank.values()))
    return planner.plan_restore(
        len(node_of_rank),
        node_of_rank,
        usable,
        block_of,
        USABLE_TIERS,
        inputs.identical,
        inputs.fan_out,
        inputs.silent,
        inputs.shapes,
    )


def begin_rollback(key: JobRef, job: JobState, incarnation: Incarnation, inputs: PlanInputs) -> tuple[int, ...] | None:
    """Begins the job's pending rollback (``job.pending_rollback()``, not None), once per request: returns
    the lineage it starts, else None. What the job trains from there on reuses the step numbers after
    the forced step, so the copies of those steps it abandons must never be restored.

    A rollback with no restorable step at or before its step (its copies proven unusable, the older
    ones gone) never begins: it is dropped, with an error, and the job keeps its timeline and
    restores its newest step. Forking would abandon every newer step for a fresh start.

    Args:
      inputs: read before the fork, while the steps up to the rollback's are still in the lineage.
    """
    step = job.forced_step
    assert step is not None  # the caller's precondition: a rollback is pending
    # What could be restored at or before ``step``, as a check: no fan-out, no silent node set aside.
    up_to = [c for c in inputs.copies if c.step <= step]
    below = dataclasses.replace(inputs, copies=up_to, fan_out=False, silent=frozenset())
    if plan(incarnation, below, None).step is None:
        log.error(
            "job %s: the rollback to step %d is dropped: no step at or before it can be restored; "
            "the job keeps its timeline and restores its newest step",
            key,
            step,
        )
        job.forced_step = None
        return None
    job.forked = True
    return job.forks + (step,)


def replan(key: JobRef, job: JobState, incarnation: Incarnation, inputs: PlanInputs) -> None:
    """Plans the incarnation's restore anew, under a new generation.

    An operator's step that turned out unrestorable (a rank's every copy proven unusable) is never
    a fresh start: the newest restorable step of the lineage, which the rollback capped at it,
    is planned; newer steps up to it are set aside, not deleted.
    """
    forced = job.forced_step
    incarnation.plan = plan(incarnation, inputs, forced)
    if incarnation.plan.step is None and forced is not None:
        log.error(
            "job %s: step %d of the rollback cannot be restored; restoring the newest restorable step before it",
            key,
            forced,
        )
        job.forced_step = forced = None
        incarnation.plan = plan(incarnation, inputs, None)
    incarnation.generation = uuid.uuid4().hex[:12]
    incarnation.rollback = forced is not None
    incarnation.staged.clear()
    incarnation.used_sources.clear()
    if (saved := incarnation.plan.saved_nodes) is not None:
        log.info(
            "job %s incarnation %s: restore step %s saved on %d nodes, resharded onto %d: %s",
            key,
            incarnation.incarnation_id,
            incarnation.plan.step,
            saved,
            len(incarnation.node_of_rank),
            {rank: sorted({s.data_rank for s in parts}) for rank, parts in incarnation.plan.sources.items()},
        )
    else:
        log.info("job %s incarnation %s: restore step %s", key, incarnation.incarnation_id, incarnation.plan.step)


def check_listed(job: JobState, incarnation: Incarnation, nodes: dict[str, NodeState]) -> None:
    """Raises ``NotReady`` while a node of the incarnation has a backup tier and no listing of the job's backups
    is believed (the node that listed them was lost, a new one has not listed yet): a replan now would not see
    the backups and could start from scratch a job a backup would resume."""
    with_backup = any(n in nodes and nodes[n].report.has_backup for n in incarnation.node_of_rank.values())
    if with_backup and not backups.listed(job, nodes):
        raise NotReady(f"waiting for {job.decided.lister or 'a node with a backup tier'} to list the backup tier")


def stalled(incarnation: Incarnation, rank: int, liveness: Liveness, lost: frozenset[str] | None = None) -> bool:
    """Whether the rank has not staged the planned step and no source of it is left but copies proven unusable and
    holders given up (silent past the grace period) or lost (``lost_holders``; ``lost`` when the caller has them),
    for its copy or, in an elastic plan, for one old node's copy: a replan may find a step it can restore without
    them (``plan``)."""
    plan_ = incarnation.plan
    if plan_ is None or rank in incarnation.staged or plan_.step is None:
        return False
    if plan_.saved_nodes is None and any(  # one copy: the usual answer, at its first usable source (each view asks)
        (plan_.step, s.data_rank, s.holder) not in incarnation.excluded
        and (s.tier in _NO_NODE_TIERS or liveness.is_live(s.holder))
        for s in plan_.sources.get(rank, ())
    ):
        return False
    # One list of sources per copy the rank stages: in an elastic plan, one per old node (its ``data_rank``).
    parts: dict[int, list[planner.PlannedSource]] = {}
    for source in plan_.sources.get(rank, ()):
        if (plan_.step, source.data_rank, source.holder) not in incarnation.excluded:
            parts.setdefault(source.data_rank if plan_.saved_nodes is not None else 0, []).append(source)
        elif plan_.saved_nodes is not None:
            parts.setdefault(source.data_rank, [])
    if not parts:
        parts[0] = []
    if all(any(s.tier in _NO_NODE_TIERS or liveness.is_live(s.holder) for s in left) for left in parts.values()):
        return False  # the usual answer, at the first source: the silent nodes are not walked
    lost = lost_holders(incarnation, liveness.silent()) if lost is None else lost
    return any(all(s.holder in lost or not liveness.holds_data(s.holder) for s in left) for left in parts.values())


def replan_helps(
    job: JobState, incarnation: Incarnation, rank: int, liveness: Liveness, inputs: Callable[[], PlanInputs]
) -> bool:
    """Whether a replan over ``inputs()`` would change the plan the rank waits on with nothing left to try
    (``stalled``). Asked once per liveness change (``Liveness.stamp``) and count of unusable copies: a rank waiting
    on a lost node that alone holds a step no other can replace asks every few seconds until its grace period ends.

    Raises:
      NotReady: as ``check_listed``: a replan now would not see the backups.
    """
    checked = (liveness.stamp, len(incarnation.excluded))
    if incarnation.stall_checked == checked or not stalled(incarnation, rank, liveness):
        return False
    check_listed(job, incarnation, liveness.nodes)
    incarnation.stall_checked = checked
    current, candidate = incarnation.plan, plan(incarnation, inputs(), job.forced_step)
    assert current is not None  # only a plan's rank is stalled
    # The same step and no source the rank was not given (the proven-unusable ones dropped): no other can serve.
    return candidate.step != current.step or not set(candidate.sources[rank]) <= set(current.sources[rank])


def view(
    key: JobRef,
    job: JobState,
    incarnation: Incarnation,
    rank: int,
    liveness: Liveness,
    backups: dict[int, int],
    warned: WarnedOnce,
) -> RestoreView:
    """The rank's view of the plan: its sources, live holders first (a silent one, within the grace
    period, is waited for only when needed), at most ``PEER_SOURCES_PER_VIEW`` peers. A rank of a
    fan-out group (``RestorePlan.fan_out``) is told to wait while its downloader's node is live and
    has not staged; once it has, that node comes first, the store after it. A query: changes nothing."""
    plan_ = incarnation.plan
    assert plan_ is not None  # the view of a planned restore: the caller planned it
    # Liveness inlined: all 10,000 ranks' views are built at once when the job turns ready.
    timeout, now, states = liveness.node_timeout_seconds, liveness.now, liveness.nodes
    live: list[planner.PlannedSource] = []
    silent: list[planner.PlannedSource] = []
    for s in plan_.sources.get(rank, ()):
        state = states.get(s.holder)
        (
            live if s.tier in _NO_NODE_TIERS or (state is not None and now - state.last_seen <= timeout) else silent
        ).append(s)
    planned, peers = [], dict[int, int]()  # per old node of an elastic plan, else one count for all
    for s in live + silent:
        part = s.data_rank if plan_.saved_nodes is not None else 0
        peers[part] = peers.get(part, 0) + (s.tier in _PEER_TIERS)
        if s.tier not in _PEER_TIERS or peers[part] <= PEER_SOURCES_PER_VIEW:
            planned.append(s)
    pending = False
    if (downloader := plan_.fan_out.get(rank)) is not None and rank not in incarnation.staged:
        if downloader.data_rank in incarnation.staged:
            planned.insert(0, downloader)  # staged there: fetch it from that node, the store if that fails
        else:  # wait for it while its node is live; a silent one is not waited for
            state = states.get(downloader.holder)
            pending = state is not None and now - state.last_seen <= timeout
    # The nodes' shards, read once for every decode source of the view (none without one).
    shards = parity.held_shards(key, job, liveness) if any(s.tier == Tier.DECODE for s in planned) else {}
    sources = tuple(
        Source(
            s.tier,
            s.holder,
            liveness.url(s.holder),
            s.data_rank,
            _expected_files(key, job, plan_.step, s, warned),  # type: ignore[arg-type]  # no sources without a step
            backups.get(plan_.step, 0) if s.tier == Tier.BACKUP else 0,  # type: ignore[arg-type]  # as above
            recipe=(
                parity.recipe(key, job, liveness, plan_.step, s.data_rank, shards)  # type: ignore[arg-type]  # as above
                if s.tier == Tier.DECODE
                else None
            ),
        )
        for s in planned
    )
    ready = plan_.step is None or len(incarnation.staged) == len(incarnation.node_of_rank)
    return RestoreView(
        incarnation.generation, plan_.step, sources, ready, incarnation.rollback, job.forks, pending, plan_.saved_nodes
    )


def waits_on(incarnation: Incarnation | None, node_id: str) -> bool:
    """Whether a rank of the incarnation waits for ``node_id`` to download its step (fan-out): its
    view changes when that node's liveness does."""
    if incarnation is None or incarnation.plan is None:
        return False
    return any(s.holder == node_id and s.data_rank not in incarnation.staged for s in incarnation.plan.fan_out.values())


def any_stalled(incarnation: Incarnation | None, liveness: Liveness) -> bool:
    """Whether a rank of the incarnation is ``stalled``: after nodes fell silent or were given up, its view is to
    be asked again (a replan may help). One pass over the ranks, the silent nodes walked once."""
    if incarnation is None or incarnation.plan is None or incarnation.plan.step is None:
        return False
    lost = lost_holders(incarnation, liveness.silent())
    return any(stalled(incarnation, rank, liveness, lost) for rank in incarnation.plan.sources)


def _expected_files(
    key: JobRef, job: JobState, step: int, source: planner.PlannedSource, warned: WarnedOnce
) -> Files | None:
    """The checksums a copy from ``source`` must match: those the data rank's own node reported.
    None when the coordinator never saw them (it restarted after that node was lost): the
    fetching node then checks the holder's manifest."""
    owner = job.owners.checksums(step, source.data_rank)
    if owner is None and source.tier != Tier.BACKUP and warned.first((key, step, source.data_rank)):
        log.warning(
            "job %s: owner checksums of rank %d step %d unknown; %s's manifest will be checked",
            key,
            source.data_rank,
            step,
            source.holder,
        )
    return owner


class StagingOutcome(enum.Enum):
    """What a rank's staging result asks of the façade."""

    NOTHING = "nothing"
    READY = "ready"  # every rank staged: every view turns ready (bump)
    SERVING = "serving"  # a fan-out downloader staged: its identical ranks' views list its node (bump)
    REPLAN = "replan"  # a rank was left with proven-unusable sources only


def record_staged(
    key: JobRef,
    incarnation: Incarnation,
    generation: str,
    rank: int,
    source: str | None,
    bad: tuple[BadCopy, ...],
    retrying: bool,
) -> StagingOutcome:
    """Records a rank's staging result: the source it used (``tier:holder``), or None when no
    source served, and the copies proven unusable (never planned again). A copy that was merely
    unreachable is not in ``bad``: the rank retries it (``retrying``) and nothing is replanned."""
    if generation != incarnation.generation:
        return StagingOutcome.NOTHING  # a result for a plan that has since been replaced
    if bad:
        log.warning("job %s rank %d: unusable copies %s", key, rank, list(bad))
        incarnation.excluded.update(cast(BadCopy, tuple(b)) for b in bad)
    if source is not None:
        incarnation.staged.add(rank)
        incarnation.used_sources[rank] = source
        if len(incarnation.staged) == len(incarnation.node_of_rank):
            return StagingOutcome.READY
        fan_out = incarnation.plan.fan_out if incarnation.plan is not None else {}
        return StagingOutcome.SERVING if any(s.data_rank == rank for s in fan_out.values()) else StagingOutcome.NOTHING
    return StagingOutcome.NOTHING if retrying else StagingOutcome.REPLAN


def end_rollback(job: JobState, incarnation: Incarnation) -> None:
    """Every rank of the incarnation staged its planned step (``StagingOutcome.READY``): a rollback to
    that step is done, and the job's later restores take its newest step again."""
    if incarnation.plan is not None and incarnation.plan.step is not None and incarnation.plan.step == job.forced_step:
        job.forced_step, job.forked = None, False
