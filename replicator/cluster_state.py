"""The coordinator's soft state: rebuilt from node reports, so a coordinator restart loses nothing.

No I/O here; ``replicator.coordinator`` serves it over HTTP.
"""

import dataclasses
import logging
import re
import uuid

from replicator import planner
from replicator.messages import Assignment, JobSettings, NodeReport, PodReport, RestoreView

log = logging.getLogger(__name__)

JobKey = tuple[str, str]
_JOBSET_SUFFIX = re.compile(r"-[a-z0-9]+$")
# Tiers whose restore path exists in this release; the planner already knows the others.
USABLE_TIERS = frozenset({planner.Tier.LOCAL})


@dataclasses.dataclass
class NodeState:
    """The last report of a live node."""

    report: NodeReport
    last_seen: float


@dataclasses.dataclass
class Incarnation:
    """One set of live pods of a job and their ranks, plus the restore it is running.

    Attributes:
      incarnation_id: stable id, reported back by agents.
      rank_of_pod: pod uid -> rank.
      node_of_rank: rank -> node id.
      plan: the frozen restore plan, once the first rank asked.
      generation: id of ``plan``; changes when a replan excludes bad copies.
      staged: ranks that staged and verified ``plan.step``.
      excluded: copies a rank found corrupt: (step, rank, holder).
    """

    incarnation_id: str
    rank_of_pod: dict[str, int]
    node_of_rank: dict[int, str]
    plan: planner.RestorePlan | None = None
    generation: str = ""
    staged: set[int] = dataclasses.field(default_factory=set)
    excluded: set[tuple[int, int, str]] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class JobState:
    """A job's incarnation and settings."""

    incarnation: Incarnation | None = None
    settings: dict[int, JobSettings] = dataclasses.field(default_factory=dict)


class UnknownIncarnation(LookupError):
    """A request names an incarnation or rank that is not (or no longer) current."""


class ClusterState:
    """Nodes, pods, held steps and job incarnations.

    Args:
      node_timeout_seconds: a node silent this long is considered gone, with its pods and data.
    """

    def __init__(self, node_timeout_seconds: float = 15.0):
        self.node_timeout_seconds = node_timeout_seconds
        self.nodes: dict[str, NodeState] = {}
        self.jobs: dict[JobKey, JobState] = {}

    # -- reports -------------------------------------------------------------------------------

    def apply_report(self, report: NodeReport, now: float) -> list[Assignment]:
        """Records a node's report and returns the assignments of its pods that exist now."""
        self.nodes[report.node_id] = NodeState(report, now)
        self.expire(now)
        for pod in report.pods:
            job = self.jobs.setdefault((pod.namespace, pod.job), JobState())
            if pod.settings is not None and pod.rank is not None:
                job.settings.setdefault(pod.rank, pod.settings)
        for key in {(p.namespace, p.job) for p in report.pods}:
            self._reconcile(key)
        return [a for p in report.pods if (a := self.assignment(p)) is not None]

    def expire(self, now: float) -> None:
        """Forgets nodes that stopped reporting; their pods leave their incarnations."""
        for node_id in [n for n, s in self.nodes.items() if now - s.last_seen > self.node_timeout_seconds]:
            log.warning("node %s silent for %.0f s: forgetting its pods and data", node_id, now - self.nodes[node_id].last_seen)
            del self.nodes[node_id]
        for key in list(self.jobs):
            self._reconcile(key)

    def _live_pods(self, key: JobKey) -> dict[str, tuple[PodReport, str]]:
        return {
            pod.pod_uid: (pod, node_id)
            for node_id, state in self.nodes.items()
            for pod in state.report.pods
            if (pod.namespace, pod.job) == key
        }

    def _reconcile(self, key: JobKey) -> None:
        job = self.jobs[key]
        live = self._live_pods(key)
        current = job.incarnation
        if current is not None and all(uid in live for uid in current.rank_of_pod):
            return
        if current is not None:
            log.info("job %s/%s: incarnation %s ended (a pod left)", *key, current.incarnation_id)
            job.incarnation = None
        if not live:
            return
        nodes, slices = next(iter(live.values()))[0].nodes, next(iter(live.values()))[0].slices
        slots = [planner.PodSlot(uid, node, p.slice_index, p.worker_index, p.published_at) for uid, (p, node) in live.items()]
        chosen = planner.select_pods(slots, nodes)
        if chosen is None:
            return
        reported = {s.pod_uid: live[s.pod_uid][0] for s in chosen}
        previous_ids = {p.incarnation for p in reported.values()}
        kept = {uid: p.rank for uid, p in reported.items() if p.rank is not None} if len(previous_ids) == 1 else {}
        ranks = planner.assign_ranks(chosen, nodes, slices, self._newest_held(key), kept)
        adopted = previous_ids.pop() if len(previous_ids) == 1 and kept == ranks else None
        job.incarnation = Incarnation(
            incarnation_id=adopted or uuid.uuid4().hex[:12],
            rank_of_pod=ranks,
            node_of_rank={rank: live[uid][1] for uid, rank in ranks.items()},
        )
        log.info("job %s/%s: incarnation %s ranks %s", *key, job.incarnation.incarnation_id, job.incarnation.node_of_rank)

    def _newest_held(self, key: JobKey) -> dict[str, dict[int, int]]:
        newest: dict[str, dict[int, int]] = {}
        for node_id, state in self.nodes.items():
            for held in state.report.held:
                if (held.namespace, held.job) == key:
                    ranks = newest.setdefault(node_id, {})
                    ranks[held.rank] = max(ranks.get(held.rank, -1), held.step)
        return newest

    def copies(self, key: JobKey) -> list[planner.StepCopy]:
        """Every copy of the job's steps that live nodes hold."""
        return [
            planner.StepCopy(h.step, h.rank, node_id)
            for node_id, state in self.nodes.items()
            for h in state.report.held
            if (h.namespace, h.job) == key
        ]

    # -- assignments and settings --------------------------------------------------------------

    def assignment(self, pod: PodReport) -> Assignment | None:
        """The pod's rank in the current incarnation, or None while it waits."""
        incarnation = self.jobs[(pod.namespace, pod.job)].incarnation
        if incarnation is None or pod.pod_uid not in incarnation.rank_of_pod:
            return None
        rank0_node = incarnation.node_of_rank[0]
        rank0_pod = next(uid for uid, r in incarnation.rank_of_pod.items() if r == 0)
        rank0 = self._live_pods((pod.namespace, pod.job))[rank0_pod][0]
        address = self.nodes[rank0_node].report.pod_address or f"{_JOBSET_SUFFIX.sub('', rank0.pod_name)}.{rank0.subdomain}"
        return Assignment(pod.pod_uid, incarnation.incarnation_id, incarnation.rank_of_pod[pod.pod_uid], f"{address}:{rank0.jax_coordinator_port}")

    def _incarnation(self, key: JobKey, incarnation_id: str, rank: int) -> Incarnation:
        job = self.jobs.get(key)
        incarnation = job.incarnation if job else None
        if incarnation is None or incarnation.incarnation_id != incarnation_id or rank not in incarnation.node_of_rank:
            raise UnknownIncarnation(f"job {key[0]}/{key[1]} has no current incarnation {incarnation_id} with rank {rank}")
        return incarnation

    def record_settings(self, key: JobKey, incarnation_id: str, rank: int, settings: JobSettings) -> None:
        """Stores the settings a rank's ``replicator.yaml`` carried.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        self._incarnation(key, incarnation_id, rank)
        self.jobs[key].settings[rank] = settings

    # -- restore -------------------------------------------------------------------------------

    def restore_view(self, key: JobKey, incarnation_id: str, rank: int) -> RestoreView:
        """The plan for ``rank``, frozen for the incarnation at the first request.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        incarnation = self._incarnation(key, incarnation_id, rank)
        if incarnation.plan is None:
            self._replan(key, incarnation)
        plan = incarnation.plan
        sources = tuple(
            {"tier": s.tier.name.lower(), "holder": s.holder, "url": self._url(s.holder), "data_rank": s.data_rank}
            for s in plan.sources.get(rank, ())
        )
        ready = plan.step is None or len(incarnation.staged) == len(incarnation.node_of_rank)
        return RestoreView(incarnation.generation, plan.step, sources, ready)

    def _url(self, holder: str) -> str | None:
        state = self.nodes.get(holder)
        return state.report.url if state else None

    def _replan(self, key: JobKey, incarnation: Incarnation) -> None:
        copies = [c for c in self.copies(key) if (c.step, c.rank, c.holder) not in incarnation.excluded]
        blocks = {n: s.report.topology.get("block", "") for n, s in self.nodes.items()}
        incarnation.plan = planner.plan_restore(len(incarnation.node_of_rank), incarnation.node_of_rank, copies, blocks, USABLE_TIERS)
        incarnation.generation = uuid.uuid4().hex[:12]
        incarnation.staged.clear()
        log.info("job %s/%s incarnation %s: restore step %s", *key, incarnation.incarnation_id, incarnation.plan.step)

    def report_staged(self, key: JobKey, incarnation_id: str, generation: str, rank: int, bad: list[tuple[int, int, str]]) -> None:
        """Records a rank's staging result; copies it found corrupt are excluded and, if the rank
        has no source left, the whole job is replanned to an older step.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        incarnation = self._incarnation(key, incarnation_id, rank)
        if generation != incarnation.generation:
            return  # a result for a plan that has since been replaced
        if not bad:
            incarnation.staged.add(rank)
            return
        incarnation.excluded.update(bad)
        log.warning("job %s/%s rank %d: corrupt copies %s; replanning", *key, rank, bad)
        self._replan(key, incarnation)

    # -- views ---------------------------------------------------------------------------------

    def newest_complete_step(self, key: JobKey) -> int | None:
        """The newest step held, somewhere, for every rank of the job."""
        job = self.jobs.get(key)
        pods = self._live_pods(key)
        nodes = next(iter(pods.values()))[0].nodes if pods else (len(job.incarnation.node_of_rank) if job and job.incarnation else 0)
        ranks_of_step: dict[int, set[int]] = {}
        for copy in self.copies(key):
            ranks_of_step.setdefault(copy.step, set()).add(copy.rank)
        complete = [step for step, ranks in ranks_of_step.items() if nodes and len(ranks) == nodes]
        return max(complete, default=None)

    def status(self) -> dict:
        """Jobs, their incarnation (rank -> node and pod), newest complete step, and held steps."""
        jobs = []
        for key, job in sorted(self.jobs.items()):
            pods = self._live_pods(key)
            incarnation = job.incarnation
            ranks = []
            if incarnation:
                for uid, rank in sorted(incarnation.rank_of_pod.items(), key=lambda item: item[1]):
                    ranks.append({"rank": rank, "node": incarnation.node_of_rank[rank], "pod": pods[uid][0].pod_name})
            held: dict[int, dict[int, list[str]]] = {}
            for copy in self.copies(key):
                held.setdefault(copy.rank, {}).setdefault(copy.step, []).append(copy.holder)
            plan = incarnation.plan if incarnation else None
            jobs.append({
                "namespace": key[0],
                "job": key[1],
                "incarnation": incarnation.incarnation_id if incarnation else None,
                "waiting_pods": 0 if incarnation else len(pods),
                "ranks": ranks,
                "newest_complete_step": self.newest_complete_step(key),
                "restore": None if plan is None else {
                    "step": plan.step,
                    "sources": {r: s[0].tier.name.lower() + ":" + s[0].holder for r, s in plan.sources.items() if s},
                },
                "held": {rank: {step: sorted(h) for step, h in sorted(steps.items())} for rank, steps in sorted(held.items())},
            })  # fmt: skip
        return {"nodes": sorted(self.nodes), "jobs": jobs}
