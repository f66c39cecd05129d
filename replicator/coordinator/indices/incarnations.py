"""Incarnations: which set of a job's live pods runs it, and each pod's rank.

An incarnation starts when a pod for every rank is published (``assign``), or is adopted after a
coordinator restart when all of its pods still report it (``adopt``); it ends when one of its pods is
unpublished or a new pod replaces one. Pure decisions over the job's pods (``planner`` picks ranks).
"""

import dataclasses
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from replicator.coordinator import planner
from replicator.wire.messages import Assignment, JobRef, PodReport

log = logging.getLogger(__name__)

_JOBSET_SUFFIX = re.compile(r"-[a-z0-9]+$")


class UnknownIncarnation(LookupError):
    """A request names an incarnation or rank that is not (or no longer) current."""


@dataclasses.dataclass
class Incarnation:
    """One set of live pods of a job and their ranks, plus the restore it is running.

    Attributes:
      incarnation_id: stable id, reported back by agents.
      rank_of_pod: pod uid -> rank.
      node_of_rank: rank -> node id.
      created_at: unix seconds.
      plan: the frozen restore plan, once the first rank asked.
      generation: id of ``plan``; changes when a replan excludes bad copies.
      staged: ranks that staged and verified ``plan.step``.
      excluded: copies a rank found corrupt or unreachable: (step, rank, holder).
      used_sources: rank -> ``tier:holder`` it staged the step from.
      rollback: the plan restores an operator's forced step (``mtc restore-from``).
      stall_checked: (liveness stamp, unusable copies) when a stalled rank last asked whether a replan helps
        (``restores.replan_helps``), or None.
    """

    incarnation_id: str
    rank_of_pod: dict[str, int]
    node_of_rank: dict[int, str]
    created_at: float = 0.0
    plan: planner.RestorePlan | None = None
    generation: str = ""
    staged: set[int] = dataclasses.field(default_factory=set)
    excluded: set[tuple[int, int, str]] = dataclasses.field(default_factory=set)
    used_sources: dict[int, str] = dataclasses.field(default_factory=dict)
    rollback: bool = False
    stall_checked: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.pod_of_rank0 = next(uid for uid, rank in self.rank_of_pod.items() if rank == 0)
        self.nodes = frozenset(self.node_of_rank.values())
        self.rank_of_node = {
            node: rank for rank, node in sorted(self.node_of_rank.items(), reverse=True)
        }  # its lowest rank


def ended(key: JobRef, current: Incarnation, pods: dict[str, tuple[PodReport, str]], retired: set[str]) -> bool:
    """Whether ``current`` ends: one of its pods was unpublished, or a new pod replaces one. Its
    still-published pods join ``retired`` (they never join another incarnation)."""
    unpublished = [uid for uid in current.rank_of_pod if uid not in pods]
    replacements = [uid for uid in pods if uid not in current.rank_of_pod and uid not in retired]
    if not unpublished and not replacements:
        return False
    log.info(
        "job %s: incarnation %s ended (%s)",
        key,
        current.incarnation_id,
        "a pod was unpublished" if unpublished else "a new pod replaces one of it",
    )
    retired.update(uid for uid in current.rank_of_pod if uid in pods)  # the gone ones never come back
    return True


def adopt(pods: dict[str, tuple[PodReport, str]], retired: set[str], now: float) -> Incarnation | None:
    """After a coordinator restart: the incarnation all of whose pods still report it."""
    by_id: dict[str, dict[str, int]] = {}
    for uid, (pod, _) in pods.items():
        if pod.incarnation is not None and pod.rank is not None and uid not in retired:
            by_id.setdefault(pod.incarnation, {})[uid] = pod.rank
    for incarnation_id, ranks in by_id.items():
        nodes = pods[next(iter(ranks))][0].nodes
        if sorted(ranks.values()) == list(range(nodes)):
            return Incarnation(incarnation_id, ranks, {rank: pods[uid][1] for uid, rank in ranks.items()}, now)
    return None


def assign(
    pods: dict[str, tuple[PodReport, str]],
    retired: set[str],
    newest_held: Callable[[], dict[str, dict[int, int]]],
    now: float,
) -> Incarnation | None:
    """A new incarnation from pods that never belonged to one (their group is gone).

    Args:
      newest_held: called for node -> rank -> newest own step held (``ClaimIndex.newest_own``),
        only when there are pods for every rank: ranks follow the data, unless the pods'
        ``ranks_follow_data`` says the job's launcher fixes them.
    """
    fresh = {uid: v for uid, v in pods.items() if v[0].incarnation is None and uid not in retired}
    if not fresh:
        return None
    any_pod = next(iter(fresh.values()))[0]
    if len(fresh) < any_pod.nodes:
        return None
    slots = [
        planner.PodSlot(uid, node, p.slice_index, p.worker_index, p.published_at) for uid, (p, node) in fresh.items()
    ]
    chosen = planner.select_pods(slots, any_pod.nodes)
    if chosen is None:
        return None
    # A launcher that fixes ranks (torchrun) needs each pod at its JobSet index, wherever the data is.
    ranks = planner.assign_ranks(
        chosen, any_pod.nodes, any_pod.slices, newest_held() if any_pod.ranks_follow_data else {}
    )
    return Incarnation(uuid.uuid4().hex[:12], ranks, {rank: fresh[uid][1] for uid, rank in ranks.items()}, now)


def assignment(
    pod: PodReport, incarnation: Incarnation | None, pods: dict[str, tuple[PodReport, str]], rank0_address: str | None
) -> Assignment | None:
    """The pod's rank in ``incarnation``, or None while it waits.

    Args:
      rank0_address: the ``pod_address`` of rank 0's node (its ``--pod-address``), or None: then rank 0's
        ``address`` from the API server, else the JobSet DNS name derived from its pod name and attributes.
    """
    if incarnation is None or pod.pod_uid not in incarnation.rank_of_pod:
        return None
    rank0 = pods[incarnation.pod_of_rank0][0]
    address = rank0_address or rank0.address or f"{_JOBSET_SUFFIX.sub('', rank0.pod_name)}.{rank0.subdomain}"
    return Assignment(
        pod.pod_uid,
        incarnation.incarnation_id,
        incarnation.rank_of_pod[pod.pod_uid],
        f"{address}:{rank0.jax_coordinator_port}",
        len(incarnation.node_of_rank),
    )


def reconcile(key: JobRef, job: Any, now: float) -> bool:
    """The incarnation of ``job`` (a ``job.JobState``: not imported, it holds an ``Incarnation``) after its pods changed: the current one ends when a pod of it goes or
    is replaced; a new one starts (adopted after a restart, or assigned) when the pods allow, and
    its nodes become believed for their ranks, in place of the last one's (``claims.Beliefs.assign``). Returns
    whether the incarnation changed."""
    if not job.pods_changed:
        return False  # an incarnation starts or ends only when a pod comes or goes
    job.pods_changed = False
    changed = False
    if job.incarnation is not None:
        if not ended(key, job.incarnation, job.pods, job.retired_pods):
            return False
        job.incarnation, changed = None, True
    if job.pods:
        job.incarnation = adopt(job.pods, job.retired_pods, now) or assign(
            job.pods, job.retired_pods, job.claims.newest_own, now
        )
        if job.incarnation is not None:
            job.nodes = len(job.incarnation.node_of_rank)
            job.beliefs.assign(job.incarnation.node_of_rank, job.claims.holders)
            changed = True
            log.info("job %s: incarnation %s of %d ranks", key, job.incarnation.incarnation_id, job.nodes)
    return changed
