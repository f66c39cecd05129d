"""The core of the coordinator's soft state (``ClusterCore``): the jobs, the nodes' liveness, the versions
long polls wake on and the marks of jobs to decide again. ``ClusterState`` (``replicator.coordinator.state``) adds the
facades by caller. It runs as a reconciler:

- a sync step takes in what changed: a report is compared with the node's previous one, and only
  the pods, claims and listings that changed touch the job's indices (``sync``); an unchanged
  heartbeat only refreshes the node's ``last_seen``; silent nodes are expired (``liveness``);
- a decision pass per job, only when something of the job changed, at most every
  ``decide_interval(nodes)`` seconds (a 10,000-node job is decided about once a second, a small one
  at once), plus every ``_RECHECK_SECONDS`` for the rules that depend on time alone: the incarnation
  (``incarnations``), owner checksums and data-parallel identity (``job.OwnerReports``,
  ``identical_ranks``), replica placement (``replicas``), the safe step and retention (``retention``),
  the backup lister and schedule (``backups``);
- replies are assembled from those cached decisions and the reporting node's own claims.

The parts' indices (``claims``, ``identical_ranks``, ``job``) store; their policies read them. No I/O
here; ``replicator.coordinator.api.routes`` serves it over HTTP.
"""

import logging
from collections.abc import Iterable, Mapping

from replicator.coordinator import planner
from replicator.coordinator.copies import backups, replicas, retention
from replicator.coordinator.indices import incarnations, lineage, sync
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.indices.liveness import Liveness
from replicator.coordinator.planning import parity, recovery, restores, views
from replicator.wire.messages import (
    Assignment,
    JobRef,
    Lineage,
    NodeReport,
    PodReport,
    ReportReply,
)

log = logging.getLogger(__name__)

# A decision pass costs about the job's size: a job up to this size is decided on every change...
_DECIDED_AT_ONCE_NODES = 256
# ...a larger one at most every (nodes x this) seconds, capped.
_DECIDE_SECONDS_PER_NODE = 1 / 4_000
_MAX_DECIDE_INTERVAL_SECONDS = 1.0
# ...and at least this often, for rules driven by time alone (backup-interval-minutes, grace periods).
_RECHECK_SECONDS = 5.0
# Silence is checked this often: against timeouts of 15 s and more, a second late is nothing.
_EXPIRE_SECONDS = 1.0


def decide_interval(nodes: int) -> float:
    """The shortest time between two decision passes of a job of ``nodes`` nodes, seconds."""
    return (
        0.0 if nodes <= _DECIDED_AT_ONCE_NODES else min(_MAX_DECIDE_INTERVAL_SECONDS, nodes * _DECIDE_SECONDS_PER_NODE)
    )


class NodeIdTaken(Exception):
    """A report names a live node's id from another address: a second claimant is refused."""


class UnknownJob(LookupError):
    """No node has reported the job (or the coordinator has forgotten it)."""


class ClusterCore:
    """Nodes, pods, held steps and job incarnations: the sync step, the decision pass and the queries over them.
    Only it bumps a job's version (long polls wake on it) or marks a job to be decided again; the facades
    (``restore``, ``operator``) change the state through ``bump``, ``mark_dirty`` and ``decide_if_due``.

    A silent node is not a lost pod: silence past the node timeout stops orders to the node and its copies from
    counting toward safety (GC keeps more), but its pods stay in their incarnation until unpublished or replaced,
    and its copies stay restore sources, after the live ones, for ``holder_grace_seconds``.

    Args:
      node_timeout_seconds: a node silent this long (or three heartbeats, if longer) is silent: no
        orders, not counted as safe.
      holder_grace_seconds: a silent node's data is given up (and the node forgotten once no
        incarnation holds its pods) after this long.
      fan_out: a restore from the backup tier alone reads each unique shard once per identical
        group, the group's other ranks fetch it from the downloader's node (``--no-restore-fan-out``: False).
      shared_backup: identical ranks share a backup's upload, each sending its share of the files
        (``--shared-backup-upload``); else one of them uploads.

    Attributes:
      liveness: the nodes and their clock (``liveness.Liveness``); jobs: every job known, by ``JobRef``.
      decisions, identity_checks, rank_checks: cost counters: decision passes run, data-parallel identity
        comparisons made (each (step, pair) once), ranks looked at one by one for a step's safety or completeness.
    """

    def __init__(
        self,
        node_timeout_seconds: float = 15.0,
        holder_grace_seconds: float = 60.0,
        fan_out: bool = True,
        shared_backup: bool = False,
    ):
        self.liveness = Liveness(node_timeout_seconds, holder_grace_seconds)
        self.fan_out = fan_out  # restores read a backup-only step once per identical group (``planner.plan_restore``)
        self.shared_backup = shared_backup  # identical ranks share a backup's upload (``backups.orders``)
        self.jobs: dict[JobRef, JobState] = {}
        self.decisions = 0
        self.identity_checks = 0
        self.rank_checks = 0
        self._changed: set[JobRef] = set()  # jobs whose version moved since ``drain_changed``
        self.warned = sync.WarnedOnce()
        self._expired_at = float("-inf")

    @property
    def heartbeat_seconds(self) -> float:
        return self.liveness.heartbeat_seconds

    def is_live(self, node_id: str) -> bool:
        return self.liveness.is_live(node_id)

    def expire(self, now: float) -> None:
        """Marks nodes silent, and forgets those silent past the grace period whose pods no
        incarnation holds (a lost node's pods leave their incarnation when they are replaced).
        Every job of a node whose liveness changed is decided again."""
        forget, changed = self.liveness.expire(
            now, lambda: {n for job in self.jobs.values() if job.incarnation for n in job.incarnation.nodes}
        )
        for node_id in forget:
            self._apply(sync.absorb(self.jobs, self.liveness, node_id, self.liveness.nodes[node_id], None, self.warned))
            self.liveness.forget(node_id)
        affected: set[JobRef] = set()
        for state in changed:
            self.mark_dirty(state.job_keys())
            for key in state.job_keys():  # a fan-out downloader went silent (or came back): its peers stop waiting
                if key in self.jobs and restores.waits_on(self.jobs[key].incarnation, state.report.node_id):
                    self.bump(key)
                affected.add(key)
        for key in affected:  # a rank left only lost or given-up holders asks again: a replan may serve it
            if key in self.jobs and restores.any_stalled(self.jobs[key].incarnation, self.liveness):
                self.bump(key)

    def forget_node(self, node_id: str) -> None:
        """The node is gone for good (recreated under its name with another UID, proven by the API
        server): its pods and every copy it held are forgotten now, without a silent node's grace.
        Its jobs are decided again."""
        bound = self.liveness.nodes.get(node_id)
        if bound is None:
            return
        keys = bound.job_keys()
        self._apply(sync.absorb(self.jobs, self.liveness, node_id, bound, None, self.warned))
        self.liveness.forget(node_id)
        self.mark_dirty(keys)
        for key in keys:
            if key in self.jobs:
                self.bump(key)

    def tick(self, now: float) -> None:
        """Expires nodes (at most every ``_EXPIRE_SECONDS``: it visits every silent node) and runs every
        decision pass that is due; the service calls it about four times a second."""
        if now - self._expired_at >= _EXPIRE_SECONDS:
            self._expired_at = now
            self.expire(now)
        for key in list(self.jobs):
            self.decide_if_due(key)

    def drain_changed(self) -> set[JobRef]:
        """The jobs whose assignments or restore views may have changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def apply_report(self, report: NodeReport, now: float) -> ReportReply:
        """Records a node's report; answers its pods' assignments and its standing orders.

        Raises:
          NodeIdTaken: a live node of that id reports from another URL.
        """
        self.liveness.advance(now)
        bound = self.liveness.nodes.get(report.node_id)
        if bound is not None and self.is_live(report.node_id) and bound.report.url != report.url:
            raise NodeIdTaken(
                f"node id {report.node_id!r} is registered from {bound.report.url}, not {report.url}; "
                f"refused until it has been silent for {self.liveness.node_timeout_seconds:.0f} s"
            )
        if bound is not None and bound.silent:
            self.mark_dirty(bound.job_keys())  # back from silence: its copies count again, orders resume
            self.liveness.stamp += 1
        # A heartbeat that says again what the node's last report said (kept without checksums),
        # every claim and rollback of which was taken in, changes nothing: most reports at steady
        # state. A claim or a rollback that could not be taken in yet (its job unknown, the node not
        # yet the job's) is looked at again with every report.
        if (
            bound is None
            or report != bound.report
            or len(bound.claims) != len(report.held)
            or lineage.news(report, self.jobs)
        ):
            if bound is not None and bound.report.shards != report.shards:  # parity built or dropped: safety moves
                self.mark_dirty({JobRef(s.namespace, s.job) for s in (*bound.report.shards, *report.shards)})
            self._apply(sync.absorb(self.jobs, self.liveness, report.node_id, bound, report, self.warned))
        self.touch(report.node_id, now)
        for key in self.liveness.nodes[report.node_id].job_keys():
            self.decide_if_due(key)
        return self.reply_for(report.node_id, sync.wants_files(self.jobs, report))

    def _apply(self, changes: sync.Changes) -> None:
        self.mark_dirty(changes.dirty)
        for key in changes.bumped:
            self.bump(key)

    def touch(self, node_id: str, now: float) -> None:
        """The node is alive at ``now`` (its long-poll request is still open)."""
        if (back := self.liveness.touch(node_id, now)) is not None:
            self.mark_dirty(back.job_keys())  # back from silence: its copies count again, orders resume

    def reply_for(self, node_id: str, want_files: bool = False) -> ReportReply:
        """The node's assignments and standing orders, from the cached decisions."""
        state = self.liveness.nodes[node_id]
        jobs = [(key, job) for key in state.job_keys() if (job := self.jobs.get(key)) is not None]
        return ReportReply(
            assignments=tuple(a for p in state.report.pods if (a := self.assignment(p)) is not None),
            replicate=tuple(order for key, job in jobs for order in replicas.orders(key, job, state, self.liveness)),
            encode=tuple(order for key, job in jobs for order in parity.orders(key, job, state, self.liveness)),
            retain=tuple(job.decided.retain for _, job in jobs if job.decided.retain is not None),
            backup=tuple(order for key, job in jobs for order in backups.orders(key, job, state, self.shared_backup)),
            heartbeat_seconds=self.heartbeat_seconds,
            want_files=want_files,
            list_backups=tuple(key for key, job in jobs if job.decided.lister == node_id),
            lineages=tuple(Lineage(key.namespace, key.job, job.forks) for key, job in jobs if job.forks),
        )

    def mark_dirty(self, keys: Iterable[JobRef]) -> None:
        for key in keys:
            if (job := self.jobs.get(key)) is not None:
                job.decided.dirty = True

    def bump(self, key: JobRef) -> None:
        self.jobs[key].decided.version += 1
        self._changed.add(key)

    def decide_if_due(self, key: JobRef) -> None:
        job = self.jobs[key]
        since = self.liveness.now - job.decided.decided_at
        if (job.decided.dirty or since >= _RECHECK_SECONDS) and (
            since >= decide_interval(job.ranks()) or job.may_form()
        ):
            self.decide(key)

    def decide(self, key: JobRef) -> None:
        """One decision pass of the job: everything that depends on more than one report."""
        job, liveness = self.jobs[key], self.liveness
        self.decisions += 1
        job.decided.dirty, job.decided.decided_at = False, liveness.now
        if incarnations.reconcile(key, job, liveness.now):
            self.bump(key)
        job.owners.promote(job.beliefs, job.identity)
        self.identity_checks += job.identity.compare()
        backed = self.backed_up(key)
        # After a cluster loss no listing is believed until a new lister lists: the backups seen
        # before are unknown, not gone, and their identities and owner checksums serve the restore.
        listed = backups.listed(job, liveness.nodes)
        held = frozenset(job.claims.step_ranks) | (backed if listed else set(job.backup_seen))
        if liveness.now - liveness.started < liveness.node_timeout_seconds:
            held |= recovery.steps(job)  # what a previous coordinator kept waits for every node's first report
        job.forget_gone_steps(held)
        if job.incarnation is not None:
            setting = job.decided.redundancy = parity.job_setting(job, liveness)
            wanted = replicas.wanted(job, liveness)
            replicas.place(job, liveness, 0 if setting.encoded else wanted)
            encoded_safe = (
                (lambda step: parity.safe(key, job, liveness, setting, step, job.identity.covered.get(step, set())))
                if setting.encoded
                else None
            )
            safe, checks = retention.safe_step(
                job, liveness, wanted, backed, lambda: retention.copies(job, liveness, True), encoded_safe
            )
            self.rank_checks += checks
            job.decided.safe = safe
            job.decided.round = replicas.choose_round(job, safe, parity.encoded_ranks(job) if setting.encoded else None)
            if parity.place_orders(job, liveness, setting):
                job.decided.dirty = True  # shards already held for a new order count from the next pass
        else:
            job.decided.safe = job.decided.round = None
        job.decided.lister = backups.choose_lister(job, liveness)
        if listed:
            backups.note_seen(job, backed, liveness.now)
        if job.incarnation is not None and job.settings:
            backups.advance(key, job, liveness, backed, lambda: self._newest_complete(job, set()))
        backups.note_safe(job, backed, liveness.now)
        # After the backup choice: it protects the step being backed up.
        job.decided.retain = retention.retain_order(key, job)

    def _newest_complete(self, job: JobState, backed: set[int]) -> int | None:
        step, checks = retention.newest_complete(job, self.liveness, backed)
        self.rank_checks += checks
        return step

    def copies(self, key: JobRef, with_backups: bool = True, live_only: bool = False) -> list[planner.StepCopy]:
        """Every believed copy of the job's steps and, optionally, complete backups.

        Args:
          live_only: only copies on live nodes (what safety and GC may count on); by default also
            those of nodes silent for less than the grace period (restore sources).
        """
        job = self.jobs.get(key)
        if job is None:
            return []
        held = retention.copies(job, self.liveness, live_only)
        held += parity.decodable(key, job, self.liveness, held)
        if not with_backups:
            return held
        ranks = job.ranks()
        return held + [planner.StepCopy.backed_up(step, rank) for step in self.backed_up(key) for rank in range(ranks)]

    def backed_up(self, key: JobRef) -> set[int]:
        """Complete backups of the job's lineage: the newest listing by a node the job ran on."""
        job = self.jobs.get(key)
        return set(backups.complete(job, self.liveness.nodes)) if job is not None else set()

    def newest_complete_step(self, key: JobRef) -> int | None:
        """The newest step held, in any tier, for every rank of the job."""
        job = self.jobs.get(key)
        return self._newest_complete(job, self.backed_up(key)) if job is not None else None

    def backup_lag(self, key: JobRef, backed: set[int]) -> tuple[int, float] | None:
        """(steps, seconds) the newest complete backup is behind the newest safe step (``backups.lag``), given the
        job's complete backups (``backed_up``)."""
        job = self.jobs.get(key)
        return backups.lag(job, backed, self.liveness.now) if job is not None else None

    def safe_step(self, key: JobRef) -> int | None:
        """The newest step complete for every rank whose every rank's data also exists elsewhere (as
        of the last decision pass, ``retention.safe_step``). GC may delete anything older."""
        return self.jobs[key].decided.safe if key in self.jobs else None

    def identical(self, key: JobRef) -> Mapping[int, frozenset[tuple[int, int]]]:
        """Step -> pairs of data-parallel peer ranks established to hold the same data at that step
        (``identical_ranks``); listed when first looked up."""
        return self.jobs[key].identity.pairs()

    def job_keys(self) -> list[JobRef]:
        """Every job the coordinator knows."""
        return list(self.jobs)

    def job(self, key: JobRef) -> views.JobView:
        """Read-only answers about one job (its incarnation, decisions, indices).

        Raises:
          KeyError: the job is unknown.
        """
        return views.JobView(self.jobs[key])

    def assignment(self, pod: PodReport) -> Assignment | None:
        """The pod's rank in the current incarnation, or None while it waits."""
        job = self.jobs[JobRef(pod.namespace, pod.job)]
        incarnation = job.incarnation
        if incarnation is None or pod.pod_uid not in incarnation.rank_of_pod:
            return None
        return incarnations.assignment(
            pod, incarnation, job.pods, self.liveness.nodes[incarnation.node_of_rank[0]].report.pod_address
        )
