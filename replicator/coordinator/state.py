"""The coordinator's soft state: rebuilt from node reports, so a coordinator restart loses nothing.

No I/O here; ``replicator.coordinator.service`` serves it over HTTP.
"""

import dataclasses
import logging
import re
import uuid

from prometheus_client import Counter

from replicator import orbax_protocol
from replicator.coordinator import planner
from replicator.messages import (
    Assignment,
    BackupOrder,
    JobSettings,
    HeldStep,
    NodeReport,
    PodReport,
    ReplicateOrder,
    ReportReply,
    RestoreView,
    RetainOrder,
    Source,
    Target,
)

log = logging.getLogger(__name__)

UNTRUSTED_CLAIMS = Counter("mtc_coordinator_untrusted_claims_total", "Held-step claims ignored: from a node never assigned the rank nor ordered to hold it")

JobKey = tuple[str, str]
_JOBSET_SUFFIX = re.compile(r"-[a-z0-9]+$")
# Tiers whose restore path exists in this release; the planner already knows the others.
USABLE_TIERS = frozenset(planner.Tier)
BACKUP_HOLDER = "backup"
_BACKUP_GIVE_UP_SECONDS = 600.0  # a chosen backup step that never completes is chosen anew
# How long a restore waits for the nodes' first listing of the backup tier before planning without it.
_BACKUP_LISTING_GRACE_SECONDS = 60.0


@dataclasses.dataclass
class NodeState:
    """The last report of a node, and whether it has fallen silent since."""

    report: NodeReport
    last_seen: float
    silent: bool = False


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


@dataclasses.dataclass
class JobState:
    """A job's incarnation, settings, and the data-parallel identities established so far.

    Attributes:
      retired_pods: pods of incarnations that ended; they never join another one.
      identical: step -> rank pairs found to hold the same data; kept after a rank's copy is lost,
        which is exactly when it is needed.
      backup_pending: the step being backed up now, or None.
      last_backup_time: unix seconds the last backup completed (for ``backup-interval-minutes``).
      forced_step: a step an operator asked the next restore to use (``mtc restore-from``).
      rank_nodes: rank -> nodes the coordinator assigned it to: only they are believed about that
        rank's own data.
      ordered: (rank, node) replica targets the coordinator chose: only they are believed about
        replicas of that rank.
      owner_files: (step, rank) -> the checksums the rank's own node reported: what every copy
        restored for that rank must match, whoever serves it.
    """

    incarnation: Incarnation | None = None
    settings: dict[int, JobSettings] = dataclasses.field(default_factory=dict)
    retired_pods: set[str] = dataclasses.field(default_factory=set)
    identical: dict[int, set[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    backup_pending: int | None = None
    backup_pending_since: float = 0.0
    last_backup_time: float | None = None
    forced_step: int | None = None
    rank_nodes: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    ordered: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    owner_files: dict[tuple[int, int], dict[str, tuple[int, str]]] = dataclasses.field(default_factory=dict)


class NodeIdTaken(Exception):
    """A report names a live node's id from another address: a second claimant is refused."""


class UnknownIncarnation(LookupError):
    """A request names an incarnation or rank that is not (or no longer) current."""


class NotReady(Exception):
    """The answer depends on reports that have not arrived yet; ask again shortly."""


class ClusterState:
    """Nodes, pods, held steps and job incarnations.

    A silent node is not a lost pod: silence past ``node_timeout_seconds`` stops orders to the node
    and its copies from counting toward safety (GC keeps more), but its pods stay in their
    incarnation until they are unpublished or replaced, and its copies stay restore sources, after
    the live ones, for ``holder_grace_seconds``: a frozen agent or a network blip costs no checkpoint.

    Args:
      node_timeout_seconds: a node silent this long is silent: no orders, not counted as safe.
      holder_grace_seconds: a silent node's data is given up (and the node forgotten once no
        incarnation holds its pods) after this long.
    """

    def __init__(self, node_timeout_seconds: float = 15.0, holder_grace_seconds: float = 60.0):
        self.node_timeout_seconds = node_timeout_seconds
        self.holder_grace_seconds = max(holder_grace_seconds, node_timeout_seconds)
        self.nodes: dict[str, NodeState] = {}
        self.jobs: dict[JobKey, JobState] = {}
        self._warned_claims: set[tuple] = set()  # what was logged once: (node, job) claims, (job, step, rank) owners
        self._now = 0.0
        self._started = float("inf")  # time of the first report: before it nothing is known  # time of the report being applied

    # -- reports -------------------------------------------------------------------------------

    def apply_report(self, report: NodeReport, now: float) -> ReportReply:
        """Records a node's report; answers its pods' assignments and its replication and GC orders.

        Raises:
          NodeIdTaken: a live node of that id reports from another URL.
        """
        self.expire(now)
        bound = self.nodes.get(report.node_id)
        if bound is not None and self.is_live(report.node_id) and bound.report.url != report.url:
            raise NodeIdTaken(f"node id {report.node_id!r} is registered from {bound.report.url}, not {report.url}; "
                              f"refused until it has been silent for {self.node_timeout_seconds:.0f} s")
        self.nodes[report.node_id] = NodeState(report, now)
        for pod in report.pods:
            job = self.jobs.setdefault((pod.namespace, pod.job), JobState())
            if pod.settings is not None and pod.rank is not None:
                job.settings.setdefault(pod.rank, pod.settings)
        keys = {(p.namespace, p.job) for p in report.pods} | {(h.namespace, h.job) for h in report.held}
        for key in keys & set(self.jobs):
            self._reconcile(key)
            self._record_owner_files(key, report)
        return ReportReply(
            assignments=tuple(a for p in report.pods if (a := self.assignment(p)) is not None),
            replicate=tuple(order for key in keys & set(self.jobs) for order in self._replicate_orders(key, report)),
            retain=tuple(order for key in keys & set(self.jobs) if (order := self._retain_order(key)) is not None),
            backup=tuple(order for key in keys & set(self.jobs) for order in self._backup_orders(key, report, now)),
        )

    def expire(self, now: float) -> None:
        """Marks nodes silent, and forgets those silent past the grace period whose pods no
        incarnation holds (a lost node's pods leave their incarnation when they are replaced)."""
        self._now = now
        self._started = min(self._started, now)
        in_use = {n for job in self.jobs.values() if job.incarnation for n in job.incarnation.node_of_rank.values()}
        for node_id, state in list(self.nodes.items()):
            silence = now - state.last_seen
            if silence > self.holder_grace_seconds and node_id not in in_use:
                log.warning("node %s silent for %.0f s: forgetting it and its data", node_id, silence)
                del self.nodes[node_id]
            elif silence > self.node_timeout_seconds and not state.silent:
                state.silent = True
                log.warning("node %s silent for %.0f s: no orders to it; its pods stay in their incarnation and its "
                            "copies stay restore sources for %.0f s", node_id, silence, self.holder_grace_seconds)  # fmt: skip
        for key in list(self.jobs):
            self._reconcile(key)

    def silence(self, node_id: str) -> float:
        """Seconds since the node last reported (infinite for an unknown node)."""
        state = self.nodes.get(node_id)
        return self._now - state.last_seen if state else float("inf")

    def is_live(self, node_id: str) -> bool:
        return self.silence(node_id) <= self.node_timeout_seconds

    def _holds_data(self, node_id: str) -> bool:
        """Whether the node's copies still count as restore sources (silent less than the grace)."""
        return self.silence(node_id) <= self.holder_grace_seconds

    def _live_pods(self, key: JobKey) -> dict[str, tuple[PodReport, str]]:
        """The job's published pods: on every node the coordinator knows, live or silent."""
        return {
            pod.pod_uid: (pod, node_id)
            for node_id, state in self.nodes.items()
            for pod in state.report.pods
            if (pod.namespace, pod.job) == key
        }

    def _reconcile(self, key: JobKey) -> None:
        job = self.jobs[key]
        live = self._live_pods(key)
        job.retired_pods &= set(live)  # a pod uid never comes back once its pod is gone
        current = job.incarnation
        if current is not None:
            unpublished = [uid for uid in current.rank_of_pod if uid not in live]
            replacements = [uid for uid in live if uid not in current.rank_of_pod and uid not in job.retired_pods]
            if not unpublished and not replacements:
                return
            log.info("job %s/%s: incarnation %s ended (%s)", *key, current.incarnation_id,
                     "a pod was unpublished" if unpublished else "a new pod replaces one of it")  # fmt: skip
            job.retired_pods.update(current.rank_of_pod)
            job.incarnation = None
        if live:
            job.incarnation = self._adopt(key, live) or self._assign(key, live)
            if job.incarnation is not None:
                for rank, node in job.incarnation.node_of_rank.items():
                    job.rank_nodes.setdefault(rank, set()).add(node)
                log.info("job %s/%s: incarnation %s ranks %s", *key, job.incarnation.incarnation_id, job.incarnation.node_of_rank)

    def _adopt(self, key: JobKey, live: dict[str, tuple[PodReport, str]]) -> Incarnation | None:
        """After a coordinator restart: the incarnation all of whose pods still report it."""
        by_id: dict[str, dict[str, int]] = {}
        for uid, (pod, _) in live.items():
            if pod.incarnation is not None and pod.rank is not None and uid not in self.jobs[key].retired_pods:
                by_id.setdefault(pod.incarnation, {})[uid] = pod.rank
        for incarnation_id, ranks in by_id.items():
            nodes = live[next(iter(ranks))][0].nodes
            if sorted(ranks.values()) == list(range(nodes)):
                return Incarnation(incarnation_id, ranks, {rank: live[uid][1] for uid, rank in ranks.items()}, self._now)
        return None

    def _assign(self, key: JobKey, live: dict[str, tuple[PodReport, str]]) -> Incarnation | None:
        """A new incarnation from pods that never belonged to one (their group is gone)."""
        job = self.jobs[key]
        fresh = {uid: v for uid, v in live.items() if v[0].incarnation is None and uid not in job.retired_pods}
        if not fresh:
            return None
        any_pod = next(iter(fresh.values()))[0]
        slots = [planner.PodSlot(uid, node, p.slice_index, p.worker_index, p.published_at) for uid, (p, node) in fresh.items()]
        chosen = planner.select_pods(slots, any_pod.nodes)
        if chosen is None:
            return None
        ranks = planner.assign_ranks(chosen, any_pod.nodes, any_pod.slices, self._newest_held(key))
        return Incarnation(uuid.uuid4().hex[:12], ranks, {rank: live[uid][1] for uid, rank in ranks.items()}, self._now)

    def _newest_held(self, key: JobKey) -> dict[str, dict[int, int]]:
        newest: dict[str, dict[int, int]] = {}
        for node_id, state in self.nodes.items():
            for held in state.report.held:
                # Own data only: a node holding a replica of another rank keeps its own rank.
                if (held.namespace, held.job) == key and not held.replica:
                    ranks = newest.setdefault(node_id, {})
                    ranks[held.rank] = max(ranks.get(held.rank, -1), held.step)
        return newest

    def _believed(self, key: JobKey, node_id: str, held: HeldStep) -> bool:
        """Whether a node's claim to hold a copy counts: its own data of a rank the coordinator
        assigned it, or a replica the coordinator ordered it to hold. Anything else (an invented
        node, a rank it never had) can neither make other nodes delete data nor serve a restore."""
        job = self.jobs.get(key)
        if job is None:
            return False
        if held.replica:
            return (held.rank, node_id) in job.ordered
        return node_id in job.rank_nodes.get(held.rank, ())

    def _record_owner_files(self, key: JobKey, report: NodeReport) -> None:
        job = self.jobs[key]
        for held in report.held:
            if (held.namespace, held.job) != key:
                continue
            if not self._believed(key, report.node_id, held):
                UNTRUSTED_CLAIMS.inc()
                if (report.node_id, key) in self._warned_claims:
                    continue
                self._warned_claims.add((report.node_id, key))
                log.warning("job %s/%s: ignoring node %s's claim to hold %s of rank %d step %d: not assigned or ordered",
                            *key, report.node_id, "a replica" if held.replica else "the data", held.rank, held.step)  # fmt: skip
            elif not held.replica:
                job.owner_files.setdefault((held.step, held.rank), held.files)
        steps = {c.step for c in self.copies(key, with_backups=False)} | self.backed_up(key)
        for step, rank in [k for k in job.owner_files if k[0] not in steps]:
            del job.owner_files[(step, rank)]

    def copies(self, key: JobKey, with_backups: bool = True, live_only: bool = False) -> list[planner.StepCopy]:
        """Every believed copy of the job's steps and, optionally, complete backups.

        Args:
          live_only: only copies on live nodes (what safety and GC may count on); by default also
            those of nodes silent for less than the grace period (restore sources).
        """
        counts = self.is_live if live_only else self._holds_data
        held = [
            planner.StepCopy(h.step, h.rank, node_id)
            for node_id, state in self.nodes.items() if counts(node_id)
            for h in state.report.held
            if (h.namespace, h.job) == key and self._believed(key, node_id, h)
        ]  # fmt: skip
        nodes = self._nodes_of(key)
        backups = [planner.StepCopy(step, rank, BACKUP_HOLDER, backup=True) for step in self.backed_up(key) for rank in range(nodes)]
        return held + backups if with_backups else held

    def _nodes_of(self, key: JobKey) -> int:
        job = self.jobs.get(key)
        if job and job.incarnation:
            return len(job.incarnation.node_of_rank)
        pods = self._live_pods(key)
        return next(iter(pods.values()))[0].nodes if pods else 0

    def backed_up(self, key: JobKey) -> set[int]:
        """Complete backups of the job, as the live nodes it ran on last listed them."""
        job = self.jobs.get(key)
        members = set().union(*job.rank_nodes.values()) if job else set()
        return {
            step for node_id, s in self.nodes.items() if node_id in members
            for b in s.report.backed_up if (b.namespace, b.job) == key for step in b.steps
        }  # fmt: skip

    def _newest_complete(self, key: JobKey, with_backups: bool) -> int | None:
        nodes = self._nodes_of(key)
        ranks_of_step: dict[int, set[int]] = {}
        for copy in self.copies(key, with_backups):
            ranks_of_step.setdefault(copy.step, set()).add(copy.rank)
        return max((step for step, ranks in ranks_of_step.items() if nodes and len(ranks) == nodes), default=None)

    def _backup_orders(self, key: JobKey, report: NodeReport, now: float) -> list[BackupOrder]:
        """Uploads of the step being backed up for the ranks whose own data this node holds.

        In a data-parallel group one member (rotating with the step, to spread the load) uploads;
        the others reference its objects and upload only what differs.
        """
        job = self.jobs[key]
        incarnation = job.incarnation
        if incarnation is None or not job.settings:
            return []
        self._advance_backup(key, now)
        step = job.backup_pending
        if step is None:
            return []
        identical = self.identical(key).get(step, frozenset())
        protected = (incarnation.plan.step,) if incarnation.plan and incarnation.plan.step is not None else ()
        orders = []
        for held in report.held:
            if (held.namespace, held.job) != key or held.replica or held.step != step:
                continue
            if incarnation.node_of_rank.get(held.rank) != report.node_id:
                continue
            group = sorted({held.rank} | {other for first, other in identical if first == held.rank})
            leader = group[step % len(group)]
            orders.append(BackupOrder(key[0], key[1], step, held.rank, incarnation.incarnation_id,
                                      len(incarnation.node_of_rank), None if leader == held.rank else leader, protected))  # fmt: skip
        return orders

    def _advance_backup(self, key: JobKey, now: float) -> None:
        """Finishes the pending backup once listed complete; starts the next one when it is due."""
        job = self.jobs[key]
        backed = self.backed_up(key)
        if job.backup_pending is not None:
            if job.backup_pending in backed:
                log.info("job %s/%s: step %d backed up", *key, job.backup_pending)
                job.last_backup_time, job.backup_pending = now, None
            elif now - job.backup_pending_since > _BACKUP_GIVE_UP_SECONDS:
                log.warning("job %s/%s: backup of step %d did not complete; choosing anew", *key, job.backup_pending)
                job.backup_pending = None
            return
        newest = self._newest_complete(key, with_backups=False)
        last = max(backed, default=None)
        if newest is None or (last is not None and newest <= last):
            return
        settings = next(iter(job.settings.values()))
        if settings.backup_interval_steps is not None:
            due = last is None or newest >= last + settings.backup_interval_steps
        else:
            due = job.last_backup_time is None or now - job.last_backup_time >= settings.backup_interval_minutes * 60
        if due:
            job.backup_pending, job.backup_pending_since = newest, now
            log.info("job %s/%s: backing up step %d", *key, newest)

    def _data_parallelism(self, key: JobKey) -> int:
        return max((s.data_parallelism for s in self.jobs[key].settings.values()), default=1)

    def identical(self, key: JobKey) -> dict[int, frozenset[tuple[int, int]]]:
        """Step -> pairs of data-parallel peer ranks established to hold the same data at that step.

        Identity rests on the job's ``assume-data-parallelism`` promise plus evidence: both ranks
        committed the step, and its structural metadata checksums (``logical_signature``) match.
        No data moves to establish it. Once established it is recorded until no copy of the step
        is left.
        """
        job = self.jobs[key]
        if self._data_parallelism(key) < 2:
            return {}
        peers = {(rank, peer) for rank, settings in job.settings.items() for peer in settings.peer_ranks}
        peers |= {(b, a) for a, b in peers}
        signatures: dict[tuple[int, int], frozenset] = {}
        for state in self.nodes.values():
            for held in state.report.held:
                if (held.namespace, held.job) == key:
                    signatures[(held.step, held.rank)] = orbax_protocol.logical_signature(held.files)
        for (step, rank), signature in signatures.items():
            for first, other in peers:
                if first == rank and signature and signatures.get((step, other)) == signature:
                    job.identical.setdefault(step, set()).add((first, other))
        for step in set(job.identical) - {step for step, _ in signatures}:
            del job.identical[step]
        return {step: frozenset(found) for step, found in job.identical.items()}

    def _blocks(self) -> dict[str, str]:
        return {n: s.report.topology.get("block", "") for n, s in self.nodes.items()}

    def _replicate_orders(self, key: JobKey, report: NodeReport) -> list[ReplicateOrder]:
        """For data parallelism 1: push this node's newest own step to its rank's replica targets."""
        job = self.jobs[key]
        incarnation = job.incarnation
        if incarnation is None or not job.settings or self._data_parallelism(key) > 1:
            return []
        targets = planner.replica_targets(incarnation.node_of_rank, self._blocks(), report.replicas)
        job.ordered.update((rank, node) for rank, nodes in targets.items() for node in nodes)
        holders: dict[tuple[int, int], set[str]] = {}
        for copy in self.copies(key):
            holders.setdefault((copy.rank, copy.step), set()).add(copy.holder)
        orders = []
        for rank, node in incarnation.node_of_rank.items():
            own = [h.step for h in report.held if (h.namespace, h.job) == key and h.rank == rank]
            if node != report.node_id or not own:
                continue
            missing = [t for t in targets[rank] if t not in holders.get((rank, max(own)), set()) and self.is_live(t)]
            if missing:
                urls = tuple(Target(t, self.nodes[t].report.url) for t in missing)
                orders.append(ReplicateOrder(key[0], key[1], rank, max(own), urls))
        return orders

    def safe_step(self, key: JobKey) -> int | None:
        """The newest step complete for every rank whose every rank's data also exists elsewhere:
        on a DP peer established identical, or on the wanted number of replicas. GC may delete
        anything older."""
        job = self.jobs[key]
        incarnation = job.incarnation
        if incarnation is None:
            return None
        nodes = len(incarnation.node_of_rank)
        holders: dict[tuple[int, int], set[str]] = {}
        for copy in self.copies(key, live_only=True):  # a silent node's copy may be gone: GC keeps more
            holders.setdefault((copy.step, copy.rank), set()).add(copy.holder)
        identical = self.identical(key)
        live = [s for n, s in self.nodes.items() if self.is_live(n)]
        wanted = 1 + min((s.report.replicas for s in live), default=1)
        for step in sorted({step for step, _ in holders}, reverse=True):
            if self._data_parallelism(key) > 1:
                covered = {a for a, _ in identical.get(step, ())}
                if all((step, r) in holders for r in range(nodes)) and covered >= set(range(nodes)):
                    return step
            elif all(len(holders.get((step, r), ())) >= min(wanted, len(live)) for r in range(nodes)):
                return step
        return None

    def _retain_order(self, key: JobKey) -> RetainOrder | None:
        safe = self.safe_step(key)
        if safe is None:
            return None
        job = self.jobs[key]
        incarnation = job.incarnation
        protected = {job.backup_pending} if job.backup_pending is not None else set()
        if incarnation and incarnation.plan and incarnation.plan.step is not None:
            protected.add(incarnation.plan.step)
        return RetainOrder(key[0], key[1], safe, tuple(sorted(protected)))

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

    def restore_view(self, key: JobKey, incarnation_id: str, rank: int, now: float) -> RestoreView:
        """The plan for ``rank``, frozen for the incarnation at the first request.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
          NotReady: nodes with a backup tier have not listed it yet (for up to 60 s): planning
            without it could start a job from scratch that a backup would have resumed. Or the
            coordinator started less than a node timeout ago: a holder that has not reported yet
            would make the plan choose an older step.
        """
        self.expire(now)
        incarnation = self._incarnation(key, incarnation_id, rank)
        if incarnation.plan is None and now - self._started < self.node_timeout_seconds:
            raise NotReady(f"the coordinator started {now - self._started:.0f} s ago; waiting for every node's report")
        if incarnation.plan is not None and rank not in incarnation.staged and incarnation.plan.step is not None:
            sources = incarnation.plan.sources.get(rank, ())
            if sources and not any(s.tier == planner.Tier.BACKUP or self._holds_data(s.holder) for s in sources):
                log.warning("job %s/%s rank %d: every holder of step %d silent past the grace period; replanning",
                            *key, rank, incarnation.plan.step)  # fmt: skip
                self._replan(key, incarnation)
        if incarnation.plan is None:
            unlisted = [
                node for node in incarnation.node_of_rank.values()
                if node in self.nodes and self.nodes[node].report.has_backup
                and not any((b.namespace, b.job) == key for b in self.nodes[node].report.backed_up)
            ]  # fmt: skip
            if unlisted and now - incarnation.created_at < _BACKUP_LISTING_GRACE_SECONDS:
                raise NotReady(f"waiting for {', '.join(sorted(unlisted))} to list the backup tier")
            self._replan(key, incarnation)
        plan = incarnation.plan
        # Live holders first; a silent one (within the grace period) is waited for only when needed.
        planned = sorted(plan.sources.get(rank, ()), key=lambda s: s.tier != planner.Tier.BACKUP and not self.is_live(s.holder))
        sources = tuple(
            Source(s.tier.name.lower(), s.holder, self._url(s.holder), s.data_rank, self._expected_files(key, plan.step, s))
            for s in planned
        )
        ready = plan.step is None or len(incarnation.staged) == len(incarnation.node_of_rank)
        if ready and plan.step is not None and plan.step == self.jobs[key].forced_step:
            self.jobs[key].forced_step = None  # done: later restores take the newest step again
        return RestoreView(incarnation.generation, plan.step, sources, ready)

    def force_restore_step(self, key: JobKey, step: int) -> None:
        """Makes the job's next restore use ``step`` (a rollback), from whichever tier holds it.

        Raises:
          LookupError: no tier holds ``step`` complete for every rank.
        """
        nodes = self._nodes_of(key)
        ranks = {c.rank for c in self.copies(key) if c.step == step} if key in self.jobs else set()
        if not nodes or ranks != set(range(nodes)):
            raise LookupError(f"step {step} of {key[0]}/{key[1]} is not complete for every rank in any tier")
        self.jobs[key].forced_step = step
        log.warning("job %s/%s: the next restore will use step %d (operator request)", *key, step)

    def _expected_files(self, key: JobKey, step: int, source: planner.Source) -> dict[str, tuple[int, str]] | None:
        """The checksums a copy from ``source`` must match: those the data rank's own node reported.
        Only if the coordinator never saw them (it restarted after that node was lost) are they the
        ones the holder reported here; never what the holder serves at fetch time."""
        owner = self.jobs[key].owner_files.get((step, source.data_rank))
        if owner is not None or source.tier == planner.Tier.BACKUP:
            return owner
        if (key, step, source.data_rank) not in self._warned_claims:
            self._warned_claims.add((key, step, source.data_rank))
            log.warning("job %s/%s: owner checksums of rank %d step %d unknown; using %s's report", *key, source.data_rank, step, source.holder)
        state = self.nodes.get(source.holder)
        held = state.report.held if state else ()
        return next((h.files for h in held if (h.namespace, h.job, h.step, h.rank) == (*key, step, source.data_rank)), None)

    def _url(self, holder: str) -> str | None:
        state = self.nodes.get(holder)
        return state.report.url if state else None

    def _replan(self, key: JobKey, incarnation: Incarnation) -> None:
        forced = self.jobs[key].forced_step
        copies = [
            c for c in self.copies(key)
            if (c.step, c.rank, c.holder) not in incarnation.excluded and (forced is None or c.step == forced)
        ]  # fmt: skip
        incarnation.plan = planner.plan_restore(
            len(incarnation.node_of_rank), incarnation.node_of_rank, copies, self._blocks(), USABLE_TIERS, self.identical(key)
        )
        incarnation.generation = uuid.uuid4().hex[:12]
        incarnation.staged.clear()
        incarnation.used_sources.clear()
        log.info("job %s/%s incarnation %s: restore step %s", *key, incarnation.incarnation_id, incarnation.plan.step)

    def report_staged(
        self, key: JobKey, incarnation_id: str, generation: str, rank: int, source: str | None,
        bad: list[tuple[int, int, str]], retrying: bool = False,
    ) -> None:
        """Records a rank's staging result: the source it used (``tier:holder``), or None when no
        source served, and the copies proven unusable (a checksum mismatch, or the holder no longer
        has it). Those are never planned again. A copy that was merely unreachable is not in
        ``bad``: the rank retries it (``retrying``) and nothing is replanned. Only a rank left with
        no source but proven-unusable ones replans the whole job, to an older step if need be.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        incarnation = self._incarnation(key, incarnation_id, rank)
        if generation != incarnation.generation:
            return  # a result for a plan that has since been replaced
        if bad:
            log.warning("job %s/%s rank %d: unusable copies %s", *key, rank, bad)
            incarnation.excluded.update(bad)
        if source is not None:
            incarnation.staged.add(rank)
            incarnation.used_sources[rank] = source
        elif not retrying:
            self._replan(key, incarnation)

    # -- views ---------------------------------------------------------------------------------

    def newest_complete_step(self, key: JobKey) -> int | None:
        """The newest step held, in any tier, for every rank of the job."""
        return self._newest_complete(key, with_backups=True)

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
                    "sources": dict(sorted(incarnation.used_sources.items())),
                    "unusable_copies": sorted(incarnation.excluded),
                },
                "held": {rank: {step: sorted(h) for step, h in sorted(steps.items())} for rank, steps in sorted(held.items())},
                "identical_peers": sorted(self.identical(key).get(self.newest_complete_step(key), ())),
                "safe_step": self.safe_step(key),
                "backups": sorted(self.backed_up(key)),
                "backup_pending": job.backup_pending,
                "forced_step": job.forced_step,
            })  # fmt: skip
        return {"nodes": sorted(n for n in self.nodes if self.is_live(n)),
                "silent_nodes": sorted(n for n in self.nodes if not self.is_live(n)), "jobs": jobs}
