"""The coordinator's soft state: rebuilt from node reports, so a coordinator restart loses nothing.

Kept incrementally, so that its cost follows what changes rather than the size of the cluster:

- A report is compared with the node's previous one. Only the pods, claims and listings that changed
  touch the job's indices (``JobState.pods``, ``claims``, ``listings``); an unchanged heartbeat only
  refreshes the node's ``last_seen``.
- A job's decisions (incarnation, owner checksums, data-parallel identity, safe step, retention,
  backup schedule, replica targets, backup lister) are recomputed in a *decision pass* only when
  something of the job changed, at most every ``decide_interval(nodes)`` seconds (a 10,000-node job
  is decided about once a second, a small one at once), plus every ``_RECHECK_SECONDS`` for the rules
  that depend on time alone.
- A reply is assembled from those cached decisions and the reporting node's own claims.

No I/O here; ``replicator.coordinator.service`` serves it over HTTP.
"""

import dataclasses
import logging
import re
import uuid
from collections.abc import Mapping

import msgspec
from prometheus_client import Counter

from replicator.coordinator import planner
from replicator.wire.messages import (
    Assignment,
    BackedUp,
    BackupOrder,
    Files,
    JobRef,
    JobSettings,
    Lineage,
    NodeReport,
    PodReport,
    ReplicateOrder,
    ReportReply,
    RestoreView,
    RetainOrder,
    Source,
    Target,
    extends,
    in_lineage,
)

log = logging.getLogger(__name__)

UNTRUSTED_CLAIMS = Counter("mtc_coordinator_untrusted_claims_total", "Held-step claims ignored: from a node never assigned the rank nor ordered to hold it")

JobKey = tuple[str, str]
Claim = tuple[JobKey, int, int, bool, int]  # (job, step, rank, replica, timeline)
_JOBSET_SUFFIX = re.compile(r"-[a-z0-9]+$")
# Tiers whose restore path exists in this release; the planner already knows the others.
USABLE_TIERS = frozenset(planner.Tier)
BACKUP_HOLDER = "backup"
_BACKUP_GIVE_UP_SECONDS = 600.0  # a chosen backup step that never completes is chosen anew
# How long a restore waits for the nodes' first listing of the backup tier before planning without it.
_BACKUP_LISTING_GRACE_SECONDS = 60.0
# A rank's restore view lists at most this many peer copies (live holders first), besides its own
# and the backup: each carries the step's checksums, and a rank of a 40-slice job has 39 identical
# peers. A peer proven bad is excluded and the replan lists the next ones.
PEER_SOURCES_PER_VIEW = 4
_PEER_TIERS = frozenset({planner.Tier.PEER_CLOSE, planner.Tier.PEER_DISTANT})
# Heartbeats: the coordinator budgets this many unchanged reports a second for the whole cluster,
# so the interval grows with the node count (1 s up to 1,000 nodes, 10 s at 10,000). Changes are
# reported at once whatever the interval.
HEARTBEATS_PER_SECOND = 1_000.0
MIN_HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 10.0
# A node is silent after missing this many heartbeats (or after --node-timeout, if longer).
_MISSED_HEARTBEATS = 3
# A decision pass costs about the job's size: a job up to this size is decided on every change...
_DECIDED_AT_ONCE_NODES = 256
# ...a larger one at most every (nodes x this) seconds, capped.
_DECIDE_SECONDS_PER_NODE = 1 / 4_000
_MAX_DECIDE_INTERVAL_SECONDS = 1.0
# ...and at least this often, for rules driven by time alone (backup-interval-minutes, grace periods).
_RECHECK_SECONDS = 5.0
# Silence is checked this often: against timeouts of 15 s and more, a second late is nothing.
_EXPIRE_SECONDS = 1.0


def _may_form(job: "JobState") -> bool:
    """Whether a job without an incarnation may have a new pod for every rank since its last pass:
    then it is decided at once, not at its paced interval, for every pod's long poll waits on it.
    ``retired_pods`` is a subset of ``pods`` (a pod leaves both when it is gone), so the count is
    an upper bound of the new pods: at worst a pass runs early."""
    if job.incarnation is not None or not job.pods_changed or not job.pods:
        return False
    return len(job.pods) - len(job.retired_pods) >= next(iter(job.pods.values()))[0].nodes


def decide_interval(nodes: int) -> float:
    """The shortest time between two decision passes of a job of ``nodes`` nodes, seconds."""
    return 0.0 if nodes <= _DECIDED_AT_ONCE_NODES else min(_MAX_DECIDE_INTERVAL_SECONDS, nodes * _DECIDE_SECONDS_PER_NODE)


@dataclasses.dataclass
class NodeState:
    """The last report of a node (its held steps without their checksums), its claims and liveness."""

    report: NodeReport
    last_seen: float
    claims: frozenset[Claim] = frozenset()
    silent: bool = False  # silent past the node timeout, as of the last ``expire``
    given_up: bool = False  # silent past the holder grace period, as of the last ``expire``

    def job_keys(self) -> set[JobKey]:
        return {(p.namespace, p.job) for p in self.report.pods} | {c[0] for c in self.claims} | {
            (b.namespace, b.job) for b in self.report.backed_up
        }


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
    rollback: bool = False  # the plan is an operator's rollback (``forced_step``)

    def __post_init__(self):
        self.pod_of_rank0 = next(uid for uid, rank in self.rank_of_pod.items() if rank == 0)
        self.nodes = frozenset(self.node_of_rank.values())
        self.rank_of_node = {node: rank for rank, node in sorted(self.node_of_rank.items(), reverse=True)}  # its lowest rank


@dataclasses.dataclass
class JobState:
    """A job's incarnation, settings, indices of what its nodes report, and its cached decisions.

    Attributes:
      retired_pods: pods of incarnations that ended and are still published; they never join another one.
      covered: step -> the ranks found to hold the same data as a data-parallel peer (their
        signatures are equal: ``identical_peers``); kept after a rank's copy is lost, which is exactly
        when it is needed. Decided once per (step, pair), in ``ClusterState._promote_owner_reports``.
        Pairs are not stored: at 10,000 ranks of 40 slices they were 390,000 tuples a step, and
        most of what the garbage collector visited.
      identity_stamp: bumped whenever ``covered`` changes (``leaders`` follows it).
      backup_pending: the step being backed up now, or None.
      last_backup_time: unix seconds the last backup completed (for ``backup-interval-minutes``).
      forced_step: a step an operator asked the next restore to use (``mtc restore-from``).
      forks: the job's rollbacks (``messages.in_lineage``): only copies of its lineage are indexed.
      forked: the timeline for ``forced_step`` has begun (once per request, however often it is planned).
      rank_nodes: rank -> nodes the coordinator assigned it to: only they are believed about that
        rank's own data.
      members: every node of ``rank_nodes`` (the nodes the job ran on), for one lookup per report.
      ordered: (rank, node) replica targets the coordinator chose: only they are believed about
        replicas of that rank.
      owner_files: (step, rank) -> the checksums the rank's own node reported: what every copy
        restored for that rank must match, whoever serves it.
      pods: pod uid -> (its report, its node), for the pods published on every known node.
      claims: (step, rank) -> {node: replica?}: every copy some node says it holds, believed or not.
      step_ranks: step -> how many ranks ``claims`` holds a copy of: a decision pass looks at a step
        rank by rank only when this says every rank may be there (``add_claim``/``drop_claim``), and
        again only after a claim of the step, a belief or a node's liveness changed (``held``).
      known_steps: the steps held in any tier at the last decision pass (tables are swept on a change).
      pods_changed: a pod was published, changed or unpublished since the last decision pass.
      pending: (step, rank, node) -> (checksums, signature) a node reported for its own data, until
        the node is believed for the rank (then they become ``owner_files`` and ``signatures``).
      signatures: (step, rank) -> the believed owner's logical signature of the step.
      uncompared: (step, rank) signatures that arrived since the last decision pass: each is
        compared with its peers' signatures of the step in the next pass, once.
      listings: node -> its last listing of the job's backups.
      dirty: something changed since the last decision pass.
      decided_at: unix seconds of the last decision pass.
      version: bumped whenever assignments or restore views may have changed (long polls wake).
      safe, retain, targets, lister: the cached decisions (see ``ClusterState``).
    """

    incarnation: Incarnation | None = None
    settings: dict[int, JobSettings] = dataclasses.field(default_factory=dict)
    retired_pods: set[str] = dataclasses.field(default_factory=set)
    covered: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    identity_stamp: int = 0
    backup_pending: int | None = None
    backup_pending_since: float = 0.0
    last_backup_time: float | None = None
    forced_step: int | None = None
    forks: tuple[int, ...] = ()
    forked: bool = False
    rank_nodes: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    members: set[str] = dataclasses.field(default_factory=set)
    ordered: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    owner_files: dict[tuple[int, int], Files] = dataclasses.field(default_factory=dict)
    pods: dict[str, tuple[PodReport, str]] = dataclasses.field(default_factory=dict)
    claims: dict[tuple[int, int], dict[str, bool]] = dataclasses.field(default_factory=dict)
    step_ranks: dict[int, int] = dataclasses.field(default_factory=dict)
    step_stamps: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> bumped whenever a claim of it changes
    belief_stamp: int = 0  # bumped whenever ``rank_nodes`` or ``ordered`` grow
    held: dict[tuple, tuple[tuple, bool]] = dataclasses.field(default_factory=dict)  # ``ClusterState._every_rank_held``'s answers and their stamps
    known_steps: frozenset[int] = frozenset()
    pods_changed: bool = True
    pending: dict[tuple[int, int, str], tuple[Files | None, str | None]] = dataclasses.field(default_factory=dict)
    signatures: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    uncompared: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    listings: dict[str, BackedUp] = dataclasses.field(default_factory=dict)
    dirty: bool = True
    decided_at: float = float("-inf")
    version: int = 0
    safe: int | None = None
    retain: RetainOrder | None = None
    targets: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    targets_for: tuple[str, int] | None = None  # (incarnation id, replicas) ``targets`` were chosen for
    ordered_for: tuple[str, int] | None = None  # ... and were added to ``ordered`` for
    replicas: int = 1  # the replicas the incarnation's nodes are configured for (``_replicas_wanted``)...
    replicas_for: tuple[str, int] | None = None  # ... as of (incarnation id, ``ClusterState._replicas_epoch``)
    leaders: tuple[tuple[int, int] | None, dict[int, int]] = dataclasses.field(default_factory=lambda: (None, {}))  # ((step, identity_stamp), rank -> backup leader)
    lister: str | None = None
    # Steps some rank's own node holds in other bytes than it first reported (``_supersede``): never
    # backed up, since the ranks' uploads could join both versions under one ``COMMIT``.
    rewritten: set[int] = dataclasses.field(default_factory=set)
    data_parallelism: int = 1
    nodes: int = 0  # ranks of the newest incarnation: known after its pods are gone (``restore-from``)
    peers: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    new_pairs: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (rank, peer), rank < peer: signatures not compared yet

    def add_settings(self, rank: int, settings: JobSettings) -> None:
        """Records a rank's settings; its data-parallel peers are peers both ways. The signatures
        of a new pair are compared in the next decision pass (once, not per rank's settings)."""
        self.settings[rank] = settings
        self.data_parallelism = max(self.data_parallelism, settings.data_parallelism)
        for peer in settings.peer_ranks:
            if peer not in self.peers.get(rank, ()):
                self.peers.setdefault(rank, set()).add(peer)
                self.peers.setdefault(peer, set()).add(rank)
                self.new_pairs.add((min(rank, peer), max(rank, peer)))
        self.dirty = True

    def identical_peers(self, step: int, rank: int) -> list[int]:
        """The data-parallel peers of ``rank`` whose owners' signatures of ``step`` equal its own
        (a signature is recorded by the decision pass that compares it with its peers')."""
        mine = self.signatures.get((step, rank))
        if mine is None:
            return []
        return [other for other in self.peers.get(rank, ()) if self.signatures.get((step, other)) == mine]

    def add_claim(self, step: int, rank: int, node_id: str, replica: bool) -> None:
        holders = self.claims.get((step, rank))
        if holders is None:
            holders = self.claims[(step, rank)] = {}
            self.step_ranks[step] = self.step_ranks.get(step, 0) + 1
        holders[node_id] = replica
        self.step_stamps[step] = self.step_stamps.get(step, 0) + 1

    def drop_claim(self, step: int, rank: int, node_id: str) -> None:
        holders = self.claims.get((step, rank))
        if holders is None or holders.pop(node_id, None) is None:
            return
        self.step_stamps[step] = self.step_stamps.get(step, 0) + 1
        if holders:
            return
        del self.claims[(step, rank)]
        if self.step_ranks[step] > 1:
            self.step_ranks[step] -= 1
        else:
            del self.step_ranks[step]


class IdenticalPairs(Mapping[int, frozenset[tuple[int, int]]]):
    """Step -> the pairs of data-parallel peer ranks (both orders) of ``job`` found identical, each
    step's listed when first looked up: a restore plan looks at one or two steps of the three held."""

    def __init__(self, job: JobState):
        self._job = job
        self._listed: dict[int, frozenset[tuple[int, int]]] = {}

    def __getitem__(self, step: int) -> frozenset[tuple[int, int]]:
        if step not in self._job.covered:
            raise KeyError(step)
        if step not in self._listed:
            self._listed[step] = frozenset((rank, other) for rank in self._job.covered[step] for other in self._job.identical_peers(step, rank))
        return self._listed[step]

    def __iter__(self):
        return iter(self._job.covered)

    def __len__(self) -> int:
        return len(self._job.covered)


class NodeIdTaken(Exception):
    """A report names a live node's id from another address: a second claimant is refused."""


class UnknownIncarnation(LookupError):
    """A request names an incarnation or rank that is not (or no longer) current."""


class NotReady(Exception):
    """The answer depends on reports that have not arrived yet; ask again shortly."""


class ClusterState:
    """Nodes, pods, held steps and job incarnations.

    A silent node is not a lost pod: silence past the node timeout stops orders to the node and its
    copies from counting toward safety (GC keeps more), but its pods stay in their incarnation until
    they are unpublished or replaced, and its copies stay restore sources, after the live ones, for
    ``holder_grace_seconds``: a frozen agent or a network blip costs no checkpoint.

    Args:
      node_timeout_seconds: a node silent this long (or three heartbeats, if longer) is silent: no
        orders, not counted as safe.
      holder_grace_seconds: a silent node's data is given up (and the node forgotten once no
        incarnation holds its pods) after this long.

    Attributes:
      decisions: decision passes run so far (a cost counter: unchanged heartbeats add none).
      identity_checks: data-parallel identity comparisons made so far (each (step, pair) once).
      rank_checks: ranks looked at one by one for a step's safety or completeness so far (only steps
        every rank may hold are: a pass costs about one job size, not one per step held).
    """

    def __init__(self, node_timeout_seconds: float = 15.0, holder_grace_seconds: float = 60.0):
        self.configured_timeout_seconds = node_timeout_seconds
        self.configured_grace_seconds = holder_grace_seconds
        self.nodes: dict[str, NodeState] = {}
        self._liveness_stamp = 0  # bumped whenever a node's ``silent`` or ``given_up`` changes
        self._by_touch: dict[str, None] = {}  # the nodes, least recently heard from first (``expire``)
        self._backup_nodes: set[str] = set()  # nodes whose last report says they have a backup tier
        self._replicas_epoch = 0  # bumped when a node reports a ``replicas`` setting it did not before
        self.jobs: dict[JobKey, JobState] = {}
        self.decisions = 0
        self.identity_checks = 0
        self.rank_checks = 0
        self.changed: set[JobKey] = set()  # jobs whose version moved since ``drain_changed``
        self._warned_claims: set[tuple] = set()  # what was logged once: (node, job) claims, (job, step, rank) owners
        self._now = 0.0  # the time of the newest event applied
        self._started = float("inf")  # time of the first report: before it nothing is known
        self._expired_at = float("-inf")

    # -- time and liveness ---------------------------------------------------------------------

    @property
    def heartbeat_seconds(self) -> float:
        """How often agents report when nothing changes: grows with the node count. Silent nodes
        count too: were the interval (and the timeout, three intervals) to shrink as nodes fall
        silent, agents still pacing themselves by the longer interval they were told would fall
        silent in turn; at 10,000 nodes that cascade stalled a whole job."""
        return min(MAX_HEARTBEAT_SECONDS, max(MIN_HEARTBEAT_SECONDS, len(self.nodes) / HEARTBEATS_PER_SECOND))

    @property
    def node_timeout_seconds(self) -> float:
        return max(self.configured_timeout_seconds, _MISSED_HEARTBEATS * self.heartbeat_seconds)

    @property
    def holder_grace_seconds(self) -> float:
        return max(self.configured_grace_seconds, self.node_timeout_seconds)

    def _advance(self, now: float) -> None:
        self._now = max(self._now, now)
        self._started = min(self._started, now)

    def silence(self, node_id: str) -> float:
        """Seconds since the node last reported (infinite for an unknown node)."""
        state = self.nodes.get(node_id)
        return self._now - state.last_seen if state else float("inf")

    def is_live(self, node_id: str) -> bool:
        return self.silence(node_id) <= self.node_timeout_seconds

    def _holds_data(self, node_id: str) -> bool:
        """Whether the node's copies still count as restore sources (silent less than the grace)."""
        return self.silence(node_id) <= self.holder_grace_seconds

    def _silent(self) -> list[str]:
        """The nodes silent past the node timeout, oldest first. Nodes are kept in the order they were
        last heard from, so this stops at the first live one: it costs the silent nodes, not the
        cluster (walking 10,000 nodes every second was 7 % of the coordinator)."""
        stale = []
        for node_id in self._by_touch:
            if self._now - self.nodes[node_id].last_seen <= self.node_timeout_seconds:
                break
            stale.append(node_id)
        return stale

    def live_nodes(self) -> int:
        """How many nodes reported within the node timeout."""
        return len(self.nodes) - len(self._silent())

    def expire(self, now: float) -> None:
        """Marks nodes silent, and forgets those silent past the grace period whose pods no
        incarnation holds (a lost node's pods leave their incarnation when they are replaced).
        Every job of a node whose liveness changed is decided again."""
        self._advance(now)
        timeout, grace = self.node_timeout_seconds, self.holder_grace_seconds
        in_use = None
        for node_id in self._silent():
            state = self.nodes[node_id]
            silence = self._now - state.last_seen
            if silence > grace and in_use is None:
                in_use = {n for job in self.jobs.values() if job.incarnation for n in job.incarnation.node_of_rank.values()}
            if silence > grace and node_id not in in_use:
                log.warning("node %s silent for %.0f s: forgetting it and its data", node_id, silence)
                self._absorb_changes(node_id, state, None)
                del self.nodes[node_id], self._by_touch[node_id]
                self._backup_nodes.discard(node_id)
                self._liveness_stamp += 1
            elif silence > timeout and not state.silent:
                state.silent = True
                self._liveness_stamp += 1
                self._mark_dirty(state.job_keys())
                log.warning("node %s silent for %.0f s: no orders to it; its pods stay in their incarnation and its "
                            "copies stay restore sources for %.0f s", node_id, silence, grace)  # fmt: skip
            elif silence > grace and not state.given_up:
                state.given_up = True
                self._liveness_stamp += 1
                self._mark_dirty(state.job_keys())  # its data is given up: the job's plans and safety change

    def tick(self, now: float) -> None:
        """Expires nodes (at most every ``_EXPIRE_SECONDS``: it visits every silent node) and runs every
        decision pass that is due; the service calls it about four times a second."""
        if now - self._expired_at >= _EXPIRE_SECONDS:
            self._expired_at = now
            self.expire(now)
        for key in list(self.jobs):
            self._decide_if_due(key)

    def drain_changed(self) -> set[JobKey]:
        """The jobs whose assignments or restore views may have changed since the last call."""
        changed, self.changed = self.changed, set()
        return changed

    # -- reports -------------------------------------------------------------------------------

    def apply_report(self, report: NodeReport, now: float) -> ReportReply:
        """Records a node's report; answers its pods' assignments and its standing orders.

        Raises:
          NodeIdTaken: a live node of that id reports from another URL.
        """
        self._advance(now)
        bound = self.nodes.get(report.node_id)
        if bound is not None and self.is_live(report.node_id) and bound.report.url != report.url:
            raise NodeIdTaken(f"node id {report.node_id!r} is registered from {bound.report.url}, not {report.url}; "
                              f"refused until it has been silent for {self.node_timeout_seconds:.0f} s")
        if bound is not None and bound.silent:
            self._mark_dirty(bound.job_keys())  # back from silence: its copies count again, orders resume
            self._liveness_stamp += 1
        # A heartbeat that says again what the node's last report said (kept without checksums),
        # every claim and rollback of which was taken in, changes nothing: most reports at steady
        # state. A claim or a rollback that could not be taken in yet (its job unknown, the node not
        # yet the job's) is looked at again with every report.
        if bound is None or report != bound.report or len(bound.claims) != len(report.held) or self._lineage_news(report):
            self._absorb_changes(report.node_id, bound, report)
        self.touch(report.node_id, now)
        for key in self.nodes[report.node_id].job_keys():
            self._decide_if_due(key)
        return self.reply_for(report.node_id, self._wants_files(report))

    def _lineage_news(self, report: NodeReport) -> bool:
        """Whether the report names rollbacks of a known job that its coordinator has not adopted."""
        return any((job := self.jobs.get((l.namespace, l.job))) is not None and extends(l.forks, job.forks) for l in report.lineages)

    def _wants_files(self, report: NodeReport) -> bool:
        """Whether the coordinator lacks checksums of a step of the node's own data that ``report``
        left out (a restarted coordinator, or one that forgot them): the reply's ``want_files``."""
        for h in report.held:
            if h.replica or h.files is not None or (job := self.jobs.get((h.namespace, h.job))) is None:
                continue
            if in_lineage(job.forks, h.step, h.timeline) and (h.step, h.rank) not in job.owner_files:
                pending = job.pending.get((h.step, h.rank, report.node_id))
                if pending is None or pending[0] is None:
                    return True
        return False

    def touch(self, node_id: str, now: float) -> None:
        """The node is alive at ``now`` (its long-poll request is still open)."""
        self._advance(now)
        if (state := self.nodes.get(node_id)) is not None:
            if state.silent:
                self._mark_dirty(state.job_keys())  # back from silence: its copies count again, orders resume
                self._liveness_stamp += 1
            state.last_seen, state.silent, state.given_up = now, False, False
            del self._by_touch[node_id]
            self._by_touch[node_id] = None  # to the end: the order stays oldest first

    def touch_rank(self, key: JobKey, incarnation_id: str, rank: int, now: float) -> None:
        """The node of ``rank`` is alive at ``now``: it is asking for its restore (a long poll that
        can outlast a heartbeat interval, and may hold the agent's only connection).

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        self.touch(self._incarnation(key, incarnation_id, rank).node_of_rank[rank], now)

    def _absorb_changes(self, node_id: str, bound: NodeState | None, report: NodeReport | None) -> None:
        """Updates the job indices with what changed between the node's last report and ``report``
        (None: the node is forgotten)."""
        old_pods = {p.pod_uid: p for p in bound.report.pods} if bound else {}
        new_pods = {p.pod_uid: p for p in report.pods} if report else {}
        for uid, pod in old_pods.items():
            job = self.jobs.get((pod.namespace, pod.job))
            if uid not in new_pods and job is not None and job.pods.get(uid, (None, None))[1] == node_id:
                del job.pods[uid]
                job.retired_pods.discard(uid)  # a pod uid never comes back once its pod is gone
                job.pods_changed = True
                self._mark_dirty({(pod.namespace, pod.job)})
        for uid, pod in new_pods.items():
            if old_pods.get(uid) != pod:
                key = (pod.namespace, pod.job)
                job = self.jobs.setdefault(key, JobState())
                job.pods[uid] = (pod, node_id)
                job.pods_changed = True
                if pod.settings is not None and pod.rank is not None and pod.rank not in job.settings:
                    job.add_settings(pod.rank, pod.settings)
                self._mark_dirty({key})
        for lineage in report.lineages if report else ():
            key = (lineage.namespace, lineage.job)
            # Only a node the job ran on is believed: a lineage abandons data on every node of the job.
            if key in self.jobs and extends(lineage.forks, self.jobs[key].forks) and node_id in self.jobs[key].members:
                log.warning("job %s/%s: node %s reports rollbacks to steps %s: adopting them", *key, node_id, lineage.forks)
                self._set_lineage(key, lineage.forks)
        old_claims = bound.claims if bound else frozenset()
        held = report.held if report else ()
        # Claims about a job no pod ever published are looked at again in the next report; copies of
        # an abandoned timeline (or of one this coordinator has not learnt of yet) are not indexed.
        held = tuple(h for h in held if (h.namespace, h.job) in self.jobs and in_lineage(self.jobs[(h.namespace, h.job)].forks, h.step, h.timeline))
        new_claims = frozenset(((h.namespace, h.job), h.step, h.rank, h.replica, h.timeline) for h in held)
        for key, step, rank, replica, _ in old_claims - new_claims:
            job = self.jobs.get(key)
            if job is None:
                continue
            job.drop_claim(step, rank, node_id)
            job.pending.pop((step, rank, node_id), None)
            self._mark_dirty({key})
        for h in held:
            key = (h.namespace, h.job)
            job = self.jobs[key]
            claim = (key, h.step, h.rank, h.replica, h.timeline)
            if claim not in old_claims:
                job.add_claim(h.step, h.rank, node_id, h.replica)
                self._mark_dirty({key})
                if job.incarnation is not None and not self._believed(job, node_id, h.rank, h.replica):
                    self._warn_untrusted(key, node_id, h.step, h.rank, h.replica)
            if h.replica:
                continue
            owner = job.owner_files.get((h.step, h.rank))
            if h.files is not None and owner is not None and h.files != owner and self._believed(job, node_id, h.rank, False):
                self._supersede(key, h.step, h.rank, node_id)
            pending = job.pending.get((h.step, h.rank, node_id))
            adds = (h.files is not None and (h.step, h.rank) not in job.owner_files) or (
                h.signature is not None and (h.step, h.rank) not in job.signatures)  # fmt: skip
            if adds and (pending is None or (pending[0] is None and h.files is not None)):
                job.pending[(h.step, h.rank, node_id)] = (h.files, h.signature)
                self._mark_dirty({key})
        if report is not None:
            old_listings = {(b.namespace, b.job): b for b in bound.report.backed_up} if bound else {}
            for listing in report.backed_up:
                key = (listing.namespace, listing.job)
                if old_listings.get(key) != listing and key in self.jobs:
                    self.jobs[key].listings[node_id] = listing
                    self._mark_dirty({key})
            stripped = tuple(msgspec.structs.replace(h, files=None) if h.files is not None else h for h in report.held)
            self.nodes[node_id] = NodeState(msgspec.structs.replace(report, held=stripped), bound.last_seen if bound else self._now, new_claims)
            self._by_touch.setdefault(node_id, None)
            (self._backup_nodes.add if report.has_backup else self._backup_nodes.discard)(node_id)
            if bound is None or bound.report.replicas != report.replicas:
                self._replicas_epoch += 1
        elif bound is not None:
            for key in bound.job_keys():
                if (job := self.jobs.get(key)) is not None and job.listings.pop(node_id, None) is not None:
                    self._mark_dirty({key})

    def _supersede(self, key: JobKey, step: int, rank: int, owner: str) -> None:
        """The rank's own node reports other checksums for a step: the job wrote the step again (a
        restore to an older step had set it aside), or the node restored it from an identical
        data-parallel peer (other bytes). What the node holds is the rank's step from now on: the
        old checksums, signature and identities are forgotten, and the other nodes' copies (of the
        old bytes) stop counting until a node reports the step anew."""
        job = self.jobs[key]
        log.warning("job %s/%s: rank %d's step %d now has other checksums (written again, or restored from a peer); "
                    "copies of the old bytes no longer count", *key, rank, step)  # fmt: skip
        del job.owner_files[(step, rank)]
        job.signatures.pop((step, rank), None)
        if (covered := job.covered.get(step)) is not None:
            covered.discard(rank)
            covered -= {other for other in job.peers.get(rank, ()) if other in covered and not job.identical_peers(step, other)}
            job.identity_stamp += 1
        for node_id in [n for n in job.claims.get((step, rank), {}) if n != owner]:
            job.drop_claim(step, rank, node_id)  # still in the node's claims: indexed again only when reported anew
        job.rewritten.add(step)
        if job.backup_pending == step:
            log.warning("job %s/%s: backup of step %d abandoned: ranks could upload different versions of it", *key, step)
            job.backup_pending = None
        job.dirty = True

    def _set_lineage(self, key: JobKey, forks: tuple[int, ...]) -> None:
        """The job's timeline moves on (a rollback, or a node reports one this coordinator missed):
        the copies, checksums, signatures and backups of abandoned timelines are forgotten."""
        job = self.jobs[key]
        lowest = min(forks[len(job.forks):])  # steps above the lowest new rollback point may be abandoned
        job.forks = forks
        job.safe = job.retain = None  # the safe step may be abandoned: GC waits for the next decision pass
        for node_id, state in self.nodes.items():
            gone = {c for c in state.claims if c[0] == key and not in_lineage(forks, c[1], c[4])}
            state.claims = state.claims - gone
            for _, step, rank, _, _ in gone:
                job.drop_claim(step, rank, node_id)
        # Until now only steps of the older lineage were indexed: above ``lowest`` they are all abandoned.
        for table in (job.owner_files, job.signatures, job.pending):
            for k in [k for k in table if k[0] > lowest]:
                del table[k]
        job.uncompared = {k for k in job.uncompared if k[0] <= lowest}
        job.rewritten = {s for s in job.rewritten if s <= lowest}
        for step in [s for s in job.covered if s > lowest]:
            del job.covered[step]
        if job.backup_pending is not None and job.backup_pending > lowest:
            job.backup_pending = None
        job.dirty = True
        self._bump(key)
        log.warning("job %s/%s: timeline %d begins at step %d; copies of newer steps of older timelines are abandoned",
                    *key, len(forks), forks[-1])  # fmt: skip

    def _mark_dirty(self, keys) -> None:
        for key in keys:
            if (job := self.jobs.get(key)) is not None:
                job.dirty = True

    def _bump(self, key: JobKey) -> None:
        self.jobs[key].version += 1
        self.changed.add(key)

    def _warn_untrusted(self, key: JobKey, node_id: str, step: int, rank: int, replica: bool) -> None:
        UNTRUSTED_CLAIMS.inc()
        if (node_id, key) not in self._warned_claims:
            self._warned_claims.add((node_id, key))
            log.warning("job %s/%s: ignoring node %s's claim to hold %s of rank %d step %d: not assigned or ordered",
                        *key, node_id, "a replica" if replica else "the data", rank, step)  # fmt: skip

    def reply_for(self, node_id: str, want_files: bool = False) -> ReportReply:
        """The node's assignments and standing orders, from the cached decisions."""
        state = self.nodes[node_id]
        keys = [key for key in state.job_keys() if key in self.jobs]
        return ReportReply(
            assignments=tuple(a for p in state.report.pods if (a := self.assignment(p)) is not None),
            replicate=tuple(order for key in keys for order in self._replicate_orders(key, state)),
            retain=tuple(job.retain for key in keys if (job := self.jobs[key]).retain is not None),
            backup=tuple(order for key in keys for order in self._backup_orders(key, state)),
            heartbeat_seconds=self.heartbeat_seconds,
            want_files=want_files,
            list_backups=tuple(JobRef(*key) for key in keys if self.jobs[key].lister == node_id),
            lineages=tuple(Lineage(*key, job.forks) for key in keys if (job := self.jobs[key]).forks),
        )

    # -- decision passes -----------------------------------------------------------------------

    def _decide_if_due(self, key: JobKey) -> None:
        job = self.jobs[key]
        since = self._now - job.decided_at
        if (job.dirty or since >= _RECHECK_SECONDS) and (since >= decide_interval(self._nodes_of(key)) or _may_form(job)):
            self.decide(key)

    def decide(self, key: JobKey) -> None:
        """One decision pass of the job: everything that depends on more than one report."""
        job = self.jobs[key]
        self.decisions += 1
        job.dirty, job.decided_at = False, self._now
        self._reconcile(key)
        self._promote_owner_reports(key)
        self._forget_gone_steps(key)
        if job.incarnation is not None:
            replicas = self._replicas_wanted(job)
            chosen_for = (job.incarnation.incarnation_id, replicas)
            if job.targets_for != chosen_for:  # placement only: chosen once per incarnation, stable across steps
                job.targets_for, job.targets = chosen_for, planner.replica_targets(
                    job.incarnation.node_of_rank, self._blocks(job.incarnation.node_of_rank.values()), chosen_for[1])
            if job.settings and self._data_parallelism(key) == 1 and job.ordered_for != chosen_for:
                job.ordered_for = chosen_for
                job.ordered.update((rank, node) for rank, nodes in job.targets.items() for node in nodes)
                job.belief_stamp += 1
        job.safe = self._safe_step(key, replicas) if job.incarnation is not None else None
        job.lister = self._choose_lister(key)
        if job.incarnation is not None and job.settings:
            self._advance_backup(key)
        job.retain = self._retain_order(key)  # after the backup choice: it protects the step being backed up

    def _reconcile(self, key: JobKey) -> None:
        job = self.jobs[key]
        if not job.pods_changed:
            return  # an incarnation starts or ends only when a pod comes or goes
        job.pods_changed = False
        live = job.pods
        current = job.incarnation
        if current is not None:
            unpublished = [uid for uid in current.rank_of_pod if uid not in live]
            replacements = [uid for uid in live if uid not in current.rank_of_pod and uid not in job.retired_pods]
            if not unpublished and not replacements:
                return
            log.info("job %s/%s: incarnation %s ended (%s)", *key, current.incarnation_id,
                     "a pod was unpublished" if unpublished else "a new pod replaces one of it")  # fmt: skip
            job.retired_pods.update(uid for uid in current.rank_of_pod if uid in live)  # the gone ones never come back
            job.incarnation = None
            self._bump(key)
        if live:
            job.incarnation = self._adopt(key) or self._assign(key)
            if job.incarnation is not None:
                job.nodes = len(job.incarnation.node_of_rank)
                for rank, node in job.incarnation.node_of_rank.items():
                    job.rank_nodes.setdefault(rank, set()).add(node)
                job.belief_stamp += 1
                job.members.update(job.incarnation.node_of_rank.values())
                self._bump(key)
                log.info("job %s/%s: incarnation %s of %d ranks", *key, job.incarnation.incarnation_id, len(job.incarnation.node_of_rank))

    def _adopt(self, key: JobKey) -> Incarnation | None:
        """After a coordinator restart: the incarnation all of whose pods still report it."""
        job = self.jobs[key]
        by_id: dict[str, dict[str, int]] = {}
        for uid, (pod, _) in job.pods.items():
            if pod.incarnation is not None and pod.rank is not None and uid not in job.retired_pods:
                by_id.setdefault(pod.incarnation, {})[uid] = pod.rank
        for incarnation_id, ranks in by_id.items():
            nodes = job.pods[next(iter(ranks))][0].nodes
            if sorted(ranks.values()) == list(range(nodes)):
                return Incarnation(incarnation_id, ranks, {rank: job.pods[uid][1] for uid, rank in ranks.items()}, self._now)
        return None

    def _assign(self, key: JobKey) -> Incarnation | None:
        """A new incarnation from pods that never belonged to one (their group is gone)."""
        job = self.jobs[key]
        fresh = {uid: v for uid, v in job.pods.items() if v[0].incarnation is None and uid not in job.retired_pods}
        if not fresh:
            return None
        any_pod = next(iter(fresh.values()))[0]
        if len(fresh) < any_pod.nodes:
            return None
        slots = [planner.PodSlot(uid, node, p.slice_index, p.worker_index, p.published_at) for uid, (p, node) in fresh.items()]
        chosen = planner.select_pods(slots, any_pod.nodes)
        if chosen is None:
            return None
        ranks = planner.assign_ranks(chosen, any_pod.nodes, any_pod.slices, self._newest_held(key))
        return Incarnation(uuid.uuid4().hex[:12], ranks, {rank: fresh[uid][1] for uid, rank in ranks.items()}, self._now)

    def _newest_held(self, key: JobKey) -> dict[str, dict[int, int]]:
        newest: dict[str, dict[int, int]] = {}
        for (step, rank), holders in self.jobs[key].claims.items():
            for node_id, replica in holders.items():
                # Own data only: a node holding a replica of another rank keeps its own rank.
                if not replica:
                    ranks = newest.setdefault(node_id, {})
                    ranks[rank] = max(ranks.get(rank, -1), step)
        return newest

    @staticmethod
    def _believed(job: JobState, node_id: str, rank: int, replica: bool) -> bool:
        """Whether a node's claim to hold a copy counts: data of a rank the coordinator assigned it
        (its own steps, or a step a restore set aside), or a replica the coordinator ordered it to
        hold. Anything else (an invented node, a rank it never had) can neither make other nodes
        delete data nor serve a restore."""
        return node_id in job.rank_nodes.get(rank, ()) or (replica and (rank, node_id) in job.ordered)

    def _promote_owner_reports(self, key: JobKey) -> None:
        """Owner checksums and signatures reported by nodes now believed for the rank become the
        job's; identity is checked for each new signature against its peers' (once per pair)."""
        job = self.jobs[key]
        for (step, rank, node_id), (files, signature) in list(job.pending.items()):
            if not self._believed(job, node_id, rank, False):
                continue
            if files is not None:
                job.owner_files.setdefault((step, rank), files)
            if signature is not None and (step, rank) not in job.signatures:
                job.signatures[(step, rank)] = signature
                job.uncompared.add((step, rank))
            if files is not None or (step, rank) in job.owner_files:
                del job.pending[(step, rank, node_id)]
        # Each pair is compared once per step: when the later of its two signatures arrives (by the
        # higher rank if both arrived since the last pass), or when the two ranks become peers.
        new, job.uncompared = job.uncompared, set()
        signatures = job.signatures
        for step, rank in new:
            # Inlined: a 40-slice job's step is 10,000 signatures of 39 peers each.
            mine, same = signatures[(step, rank)], []
            for other in job.peers.get(rank, ()):
                theirs = signatures.get((step, other))
                if theirs is not None and not (other > rank and (step, other) in new):
                    self.identity_checks += 1
                    if theirs == mine:
                        same.append(other)
            if same:
                self._record_identical(job, step, same + [rank])
        if job.new_pairs:
            steps = {step for step, _ in signatures}
            for rank, other in job.new_pairs:
                for step in steps:
                    if (step, rank) in signatures and (step, other) in signatures and (step, rank) not in new and (step, other) not in new:
                        self.identity_checks += 1
                        if signatures[(step, rank)] == signatures[(step, other)]:
                            self._record_identical(job, step, [rank, other])
            job.new_pairs.clear()

    @staticmethod
    def _record_identical(job: JobState, step: int, ranks: list[int]) -> None:
        """Each of ``ranks`` holds the same data as a data-parallel peer at ``step``."""
        job.covered.setdefault(step, set()).update(ranks)
        job.identity_stamp += 1

    def _forget_gone_steps(self, key: JobKey) -> None:
        """Checksums, signatures and identities of steps no copy or backup holds any more."""
        job = self.jobs[key]
        steps = frozenset(job.step_ranks) | self.backed_up(key)
        if steps == job.known_steps:
            return  # the tables hold only steps that were held at the last sweep
        job.known_steps = steps
        for table in (job.owner_files, job.signatures):
            for step, rank in [k for k in table if k[0] not in steps]:
                del table[(step, rank)]
        for step in set(job.covered) - steps:
            del job.covered[step]
        job.rewritten &= steps
        for step in [s for s in job.step_stamps if s not in job.step_ranks]:
            del job.step_stamps[step]  # with its answers: a stamp counted anew never meets an old answer
        job.held = {k: v for k, v in job.held.items() if k[0] in job.step_stamps}

    def copies(self, key: JobKey, with_backups: bool = True, live_only: bool = False) -> list[planner.StepCopy]:
        """Every believed copy of the job's steps and, optionally, complete backups.

        Args:
          live_only: only copies on live nodes (what safety and GC may count on); by default also
            those of nodes silent for less than the grace period (restore sources).
        """
        job = self.jobs.get(key)
        if job is None:
            return []
        # is_live / _holds_data, inlined: a 10,000-rank job has 30,000 claims and more per pass.
        limit, now, nodes = self.node_timeout_seconds if live_only else self.holder_grace_seconds, self._now, self.nodes
        held = [
            planner.StepCopy(step, rank, node_id)
            for (step, rank), holders in job.claims.items()
            for node_id, replica in holders.items()
            if (state := nodes.get(node_id)) is not None and now - state.last_seen <= limit and self._believed(job, node_id, rank, replica)
        ]  # fmt: skip
        if not with_backups:
            return held
        nodes = self._nodes_of(key)
        return held + [planner.StepCopy(step, rank, BACKUP_HOLDER, backup=True) for step in self.backed_up(key) for rank in range(nodes)]

    def _nodes_of(self, key: JobKey) -> int:
        job = self.jobs.get(key)
        if job and job.incarnation:
            return len(job.incarnation.node_of_rank)
        if job and job.pods:
            return next(iter(job.pods.values()))[0].nodes
        return job.nodes if job else 0

    def backed_up(self, key: JobKey) -> set[int]:
        """Complete backups of the job's lineage: the newest listing by a node the job ran on."""
        return set(self._backups(key))

    def _backups(self, key: JobKey) -> dict[int, int]:
        """Step -> timeline of the complete backups of the job's lineage (the newest timeline if a
        step was backed up in several)."""
        job = self.jobs.get(key)
        if job is None:
            return {}
        listings = [b for node_id, b in job.listings.items() if node_id in job.members and node_id in self.nodes]
        if not listings:
            return {}
        found: dict[int, int] = {}
        for step, timeline in sorted(max(listings, key=lambda b: b.listed_at).steps):
            if in_lineage(job.forks, step, timeline):
                found[step] = timeline
        return found

    def _newest_complete(self, key: JobKey, with_backups: bool) -> int | None:
        job = self.jobs.get(key)
        nodes = self._nodes_of(key)
        if job is None or not nodes:
            return None
        backups = self.backed_up(key) if with_backups else set()
        for step in sorted(backups.union(job.step_ranks), reverse=True):
            if step in backups or self._every_rank_held(job, step, nodes, 1, live_only=False):
                return step
        return None

    def _every_rank_held(self, job: JobState, step: int, nodes: int, wanted: int, live_only: bool) -> bool:
        """Whether each of ranks 0..nodes-1 of ``step`` has at least ``wanted`` believed copies on
        nodes not silent (``live_only``) or not given up, as of the last ``expire``.

        Costs O(nodes) only for a step every rank may hold (``JobState.step_ranks``), stops at the
        first rank short of copies, and is answered from ``JobState.held`` until a claim of the step,
        a belief or a node's liveness changed: a complete step is looked at once, not once a pass.
        """
        if job.step_ranks.get(step, 0) < nodes:
            return False
        stamp = (job.step_stamps.get(step), job.belief_stamp, self._liveness_stamp)
        cached = job.held.get((step, nodes, wanted, live_only))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        held = self._walk_ranks(job, step, nodes, wanted, live_only)
        job.held[(step, nodes, wanted, live_only)] = (stamp, held)
        return held

    def _walk_ranks(self, job: JobState, step: int, nodes: int, wanted: int, live_only: bool) -> bool:
        states, claims, rank_nodes, ordered = self.nodes, job.claims, job.rank_nodes, job.ordered
        for rank in range(nodes):
            self.rank_checks += 1
            found = 0
            for node_id, replica in claims.get((step, rank), {}).items():
                state = states.get(node_id)
                # ``_believed``, inlined: this runs for every rank of a 10,000-rank job.
                if state is not None and not (state.silent if live_only else state.given_up) and (
                        node_id in rank_nodes.get(rank, ()) or (replica and (rank, node_id) in ordered)):  # fmt: skip
                    found += 1
            if found < wanted:
                return False
        return True

    def _blocks(self, node_ids) -> dict[str, str]:
        return {n: self.nodes[n].report.topology.get("block", "") for n in node_ids if n in self.nodes}

    def _replicas_wanted(self, job: JobState) -> int:
        """The fewest replicas any node of the incarnation is configured for (``--replicas``);
        recomputed only after a node reported another setting (it visits every node)."""
        if job.replicas_for != (job.incarnation.incarnation_id, self._replicas_epoch):
            reports = [self.nodes[n].report for n in job.incarnation.nodes if n in self.nodes]
            job.replicas_for, job.replicas = (job.incarnation.incarnation_id, self._replicas_epoch), min((r.replicas for r in reports), default=1)
        return job.replicas

    def _replicate_orders(self, key: JobKey, state: NodeState) -> list[ReplicateOrder]:
        """For data parallelism 1: push this node's newest own step to its rank's replica targets."""
        job = self.jobs[key]
        incarnation = job.incarnation
        if incarnation is None or not job.settings or self._data_parallelism(key) > 1:
            return []
        node_id = state.report.node_id
        newest: dict[int, int] = {}
        for claim_key, step, rank, replica, _ in state.claims:
            if claim_key == key and not replica and incarnation.node_of_rank.get(rank) == node_id:
                newest[rank] = max(newest.get(rank, -1), step)
        orders = []
        for rank, step in newest.items():
            holders = job.claims.get((step, rank), {})
            missing = [t for t in job.targets.get(rank, ()) if t not in holders and self.is_live(t)]
            if missing:
                orders.append(ReplicateOrder(key[0], key[1], rank, step, tuple(Target(t, self.nodes[t].report.url) for t in missing)))
        return orders

    def safe_step(self, key: JobKey) -> int | None:
        """The newest step complete for every rank whose every rank's data also exists elsewhere (as
        of the last decision pass): on a DP peer established identical, or on the wanted number of
        holders, a complete backup of the lineage counting as one. GC may delete anything older."""
        return self.jobs[key].safe if key in self.jobs else None

    def _safe_step(self, key: JobKey, replicas: int) -> int | None:
        job = self.jobs[key]
        incarnation = job.incarnation
        nodes = len(incarnation.node_of_rank)
        # Holders wanted per rank: 1 + replicas, or fewer while fewer nodes of the job are live.
        wanted = 0
        for node_id in incarnation.nodes:
            wanted += self.is_live(node_id)
            if wanted > replicas:
                break
        data_parallel = self._data_parallelism(key) > 1
        backed_up = self.backed_up(key)
        # Live copies only: a silent node's copy may be gone, GC keeps more.
        for step in sorted(job.step_ranks, reverse=True):
            if data_parallel:
                if len(job.covered.get(step, ())) >= nodes and job.covered[step].issuperset(range(nodes)) and \
                        self._every_rank_held(job, step, nodes, 1, live_only=True):  # fmt: skip
                    return step
                continue
            # A complete backup counts as one holder: a replica in flight does not hold GC back, and
            # a corrupt backup object alone never leaves a rank with a single copy.
            need = wanted - (step in backed_up)
            if need <= 0:
                if any(c.step == step for c in self.copies(key, with_backups=False, live_only=True)):
                    return step  # at most one live node: any live copy of a backed-up step will do
            elif self._every_rank_held(job, step, nodes, need, live_only=True):
                return step
        return None

    def _retain_order(self, key: JobKey) -> RetainOrder | None:
        job = self.jobs[key]
        if job.safe is None or (job.forced_step is not None and not job.forked):
            return None  # nothing is safe yet, or a rollback is pending: any step up to it may be needed
        incarnation = job.incarnation
        protected = {job.backup_pending} if job.backup_pending is not None else set()
        if incarnation and incarnation.plan and incarnation.plan.step is not None:
            protected.add(incarnation.plan.step)
        return RetainOrder(key[0], key[1], job.safe, tuple(sorted(protected)))

    def _choose_lister(self, key: JobKey) -> str | None:
        """The one node that lists the job's backups: rank 0's node if it can, else the lowest
        rank's live node with a backup tier, else any live node with the job's pods."""
        job = self.jobs[key]
        incarnation = job.incarnation
        nodes = incarnation.nodes if incarnation is not None else {node for _, node in job.pods.values()}
        if job.lister in nodes and job.lister in self._backup_nodes and self.is_live(job.lister):
            return job.lister  # stable while it can: a new lister lists again
        able = [n for n in self._backup_nodes.intersection(nodes) if self.is_live(n)]
        order = incarnation.rank_of_node.get if incarnation is not None else None
        return min(able, key=lambda n: (order(n), n) if order else n, default=None)

    def _backup_orders(self, key: JobKey, state: NodeState) -> list[BackupOrder]:
        """Uploads of the step being backed up for the ranks whose own data this node holds.

        In a data-parallel group one member (rotating with the step, to spread the load) uploads;
        the others reference its objects and upload only what differs.
        """
        job = self.jobs[key]
        incarnation = job.incarnation
        step = job.backup_pending
        if incarnation is None or step is None:
            return []
        node_id = state.report.node_id
        protected = (incarnation.plan.step,) if incarnation.plan and incarnation.plan.step is not None else ()
        orders = []
        for claim_key, held_step, rank, replica, _ in state.claims:
            if claim_key != key or replica or held_step != step or incarnation.node_of_rank.get(rank) != node_id:
                continue
            leader = self._backup_leader(job, step, rank)
            orders.append(BackupOrder(key[0], key[1], step, rank, incarnation.incarnation_id, len(incarnation.node_of_rank),
                                      None if leader == rank else leader, protected, len(job.forks), job.forks))  # fmt: skip
        return orders

    @staticmethod
    def _backup_leader(job: JobState, step: int, rank: int) -> int:
        """The rank of ``rank``'s identical group that uploads ``step``: kept per (step, rank) until
        more ranks are found identical (a report must not walk 39 peers each time)."""
        if job.leaders[0] != (step, job.identity_stamp):
            job.leaders = ((step, job.identity_stamp), {})
        leader = job.leaders[1].get(rank)
        if leader is None:
            group = sorted([rank] + (job.identical_peers(step, rank) if rank in job.covered.get(step, ()) else []))
            leader = job.leaders[1][rank] = group[step % len(group)]
        return leader

    def _advance_backup(self, key: JobKey) -> None:
        """Finishes the pending backup once listed complete; starts the next one when it is due."""
        job = self.jobs[key]
        now = self._now
        backed = self.backed_up(key)
        if job.backup_pending is not None:
            if job.backup_pending in backed:
                log.info("job %s/%s: step %d backed up", *key, job.backup_pending)
                job.last_backup_time, job.backup_pending = now, None
            elif now - job.backup_pending_since > _BACKUP_GIVE_UP_SECONDS:
                log.warning("job %s/%s: backup of step %d did not complete; choosing anew", *key, job.backup_pending)
                job.backup_pending = None
            return
        if job.lister is None:
            return  # no live node of the job has a backup tier: a chosen step would only be kept from GC
        newest = self._newest_complete(key, with_backups=False)
        last = max(backed, default=None)
        if newest is None or (last is not None and newest <= last) or newest in job.rewritten:
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
        return self.jobs[key].data_parallelism

    def identical(self, key: JobKey) -> Mapping[int, frozenset[tuple[int, int]]]:
        """Step -> pairs of data-parallel peer ranks established to hold the same data at that step.

        Identity rests on the job's ``assume-data-parallelism`` promise plus evidence: both ranks
        committed the step, and their owners' logical signatures (``orbax_protocol.logical_signature``,
        computed by the agents) are equal. No data moves to establish it. Once established it is
        recorded until no copy of the step is left. A step's pairs are listed when first looked up.
        """
        job = self.jobs[key]
        if self._data_parallelism(key) < 2:
            return {}
        return IdenticalPairs(job)

    # -- assignments and settings --------------------------------------------------------------

    def assignment(self, pod: PodReport) -> Assignment | None:
        """The pod's rank in the current incarnation, or None while it waits."""
        job = self.jobs[(pod.namespace, pod.job)]
        incarnation = job.incarnation
        if incarnation is None or pod.pod_uid not in incarnation.rank_of_pod:
            return None
        rank0_node = incarnation.node_of_rank[0]
        rank0 = job.pods[incarnation.pod_of_rank0][0]
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
        self.jobs[key].add_settings(rank, settings)
        self._decide_if_due(key)

    # -- restore -------------------------------------------------------------------------------

    def restore_view(self, key: JobKey, incarnation_id: str, rank: int, now: float) -> RestoreView:
        """The plan for ``rank``, frozen for the incarnation at the first request.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
          NotReady: the job's nodes with a backup tier have not listed it yet (for up to 60 s):
            planning without it could start a job from scratch that a backup would have resumed.
            Or the coordinator started less than a node timeout ago: a holder that has not reported
            yet would make the plan choose an older step.
        """
        self._advance(now)
        incarnation = self._incarnation(key, incarnation_id, rank)
        job = self.jobs[key]
        if incarnation.plan is None and now - self._started < self.node_timeout_seconds:
            raise NotReady(f"the coordinator started {now - self._started:.0f} s ago; waiting for every node's report")
        if incarnation.plan is not None and rank not in incarnation.staged and incarnation.plan.step is not None:
            sources = incarnation.plan.sources.get(rank, ())
            if sources and not any(s.tier == planner.Tier.BACKUP or self._holds_data(s.holder) for s in sources):
                log.warning("job %s/%s rank %d: every holder of step %d silent past the grace period; replanning",
                            *key, rank, incarnation.plan.step)  # fmt: skip
                self._replan(key, incarnation)
        if incarnation.plan is None:
            if job.dirty:
                # Plan on every report that has arrived, but decide a large job at most every
                # ``decide_interval``: its N ranks asking at once must not cost N decision passes.
                self._decide_if_due(key)
                if job.dirty:
                    raise NotReady("the job's newest reports are being decided")
            backup_nodes = [n for n in incarnation.node_of_rank.values() if n in self.nodes and self.nodes[n].report.has_backup]
            if backup_nodes and not any(n in job.listings for n in backup_nodes) and now - incarnation.created_at < _BACKUP_LISTING_GRACE_SECONDS:
                raise NotReady(f"waiting for {job.lister or 'a node with a backup tier'} to list the backup tier")
            self._replan(key, incarnation)
        plan = incarnation.plan
        # Live holders first; a silent one (within the grace period) is waited for only when needed.
        # Liveness inlined: all 10,000 ranks' views are built at once when the job turns ready.
        timeout, now, states = self.node_timeout_seconds, self._now, self.nodes
        live, silent = [], []
        for s in plan.sources.get(rank, ()):
            state = states.get(s.holder)
            (live if s.tier == planner.Tier.BACKUP or (state is not None and now - state.last_seen <= timeout) else silent).append(s)
        planned, peers = [], 0
        for s in live + silent:
            peers += s.tier in _PEER_TIERS
            if s.tier not in _PEER_TIERS or peers <= PEER_SOURCES_PER_VIEW:
                planned.append(s)
        backups = self._backups(key)
        sources = tuple(
            Source(s.tier, s.holder, self._url(s.holder), s.data_rank, self._expected_files(key, plan.step, s),
                   backups.get(plan.step, 0) if s.tier == planner.Tier.BACKUP else 0)
            for s in planned
        )  # fmt: skip
        ready = plan.step is None or len(incarnation.staged) == len(incarnation.node_of_rank)
        if ready and plan.step is not None and plan.step == job.forced_step:
            job.forced_step, job.forked = None, False  # done: later restores take the newest step again
        return RestoreView(incarnation.generation, plan.step, sources, ready, incarnation.rollback, job.forks)

    def force_restore_step(self, key: JobKey, step: int) -> None:
        """Makes the job's next restore use ``step`` (a rollback), from whichever tier holds it.
        Works while the job has no pods (its nodes still report its data): that is when an
        operator rolls back.

        Raises:
          LookupError: no tier holds ``step`` complete for every rank.
        """
        nodes = self._nodes_of(key)
        ranks = {c.rank for c in self.copies(key) if c.step == step}
        if not nodes or ranks != set(range(nodes)):
            raise LookupError(f"step {step} of {key[0]}/{key[1]} is not complete for every rank in any tier")
        self.jobs[key].forced_step, self.jobs[key].forked = step, False
        log.warning("job %s/%s: the next restore will use step %d (operator request)", *key, step)

    def _expected_files(self, key: JobKey, step: int, source: planner.Source) -> Files | None:
        """The checksums a copy from ``source`` must match: those the data rank's own node reported.
        None when the coordinator never saw them (it restarted after that node was lost): the
        fetching node then checks the holder's manifest."""
        owner = self.jobs[key].owner_files.get((step, source.data_rank))
        if owner is None and source.tier != planner.Tier.BACKUP and (key, step, source.data_rank) not in self._warned_claims:
            self._warned_claims.add((key, step, source.data_rank))
            log.warning("job %s/%s: owner checksums of rank %d step %d unknown; %s's manifest will be checked", *key,
                        source.data_rank, step, source.holder)  # fmt: skip
        return owner

    def _url(self, holder: str) -> str | None:
        state = self.nodes.get(holder)
        return state.report.url if state else None

    def _replan(self, key: JobKey, incarnation: Incarnation) -> None:
        job = self.jobs[key]
        forced = job.forced_step
        if forced is not None and not job.forked:
            # A rollback starts a new timeline: what the job trains from here on reuses the step
            # numbers after ``forced``, so the copies of those steps it abandons must never be restored.
            job.forked = True
            self._set_lineage(key, job.forks + (forced,))
        incarnation.plan = self._plan(key, incarnation, forced)
        if incarnation.plan.step is None and forced is not None:
            # The operator's step turned out unrestorable (a rank's every copy proven unusable). Never
            # a fresh start for it: the newest restorable step of the lineage, which the rollback
            # capped at ``forced``; newer steps up to it are set aside, not deleted.
            log.error("job %s/%s: step %d of the rollback cannot be restored; restoring the newest restorable step before it",
                      *key, forced)  # fmt: skip
            job.forced_step = forced = None
            incarnation.plan = self._plan(key, incarnation, None)
        incarnation.generation = uuid.uuid4().hex[:12]
        incarnation.rollback = forced is not None
        incarnation.staged.clear()
        incarnation.used_sources.clear()
        self.jobs[key].retain = self._retain_order(key)  # the planned step is protected from now on
        self._bump(key)
        log.info("job %s/%s incarnation %s: restore step %s", *key, incarnation.incarnation_id, incarnation.plan.step)

    def _plan(self, key: JobKey, incarnation: Incarnation, forced: int | None) -> planner.RestorePlan:
        """The restore plan over the copies not proven unusable (only ``forced``'s, if given)."""
        copies = [
            c for c in self.copies(key)
            if (c.step, c.rank, c.holder) not in incarnation.excluded and (forced is None or c.step == forced)
        ]  # fmt: skip
        return planner.plan_restore(
            len(incarnation.node_of_rank), incarnation.node_of_rank, copies, self._blocks({c.holder for c in copies} | set(incarnation.node_of_rank.values())),
            USABLE_TIERS, self.identical(key),
        )  # fmt: skip

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
            if len(incarnation.staged) == len(incarnation.node_of_rank):
                self._bump(key)  # every rank's view turns ready
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
            incarnation = job.incarnation
            ranks = []
            if incarnation:
                for uid, rank in sorted(incarnation.rank_of_pod.items(), key=lambda item: item[1]):
                    ranks.append({"rank": rank, "node": incarnation.node_of_rank[rank], "pod": job.pods[uid][0].pod_name})
            held: dict[int, dict[int, list[str]]] = {}
            for copy in self.copies(key):
                held.setdefault(copy.rank, {}).setdefault(copy.step, []).append(copy.holder)
            plan = incarnation.plan if incarnation else None
            jobs.append({
                "namespace": key[0],
                "job": key[1],
                "incarnation": incarnation.incarnation_id if incarnation else None,
                "waiting_pods": 0 if incarnation else len(job.pods),
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
                "backup_lister": job.lister,
                "forced_step": job.forced_step,
                "timeline": len(job.forks),
                "rollbacks": list(job.forks),
            })  # fmt: skip
        return {"nodes": sorted(n for n in self.nodes if self.is_live(n)),
                "silent_nodes": sorted(n for n in self.nodes if not self.is_live(n)), "jobs": jobs,
                "heartbeat_seconds": self.heartbeat_seconds}  # fmt: skip
