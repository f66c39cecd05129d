"""The sync step: what changed between a node's last report and its new one goes into the job
indices, in named steps (pods, rollbacks, claims, owner reports, backup listings). It decides
nothing; it says which jobs are to be decided again and whose version moved (``Changes``), and
the façade (``ClusterState``) marks and bumps them.
"""

import dataclasses
import logging
from collections.abc import Iterable

import msgspec
from prometheus_client import Counter

from replicator.coordinator.indices import lineage
from replicator.coordinator.indices.claims import Claim
from replicator.coordinator.indices.job import JobState, pack_files
from replicator.coordinator.indices.liveness import Liveness, NodeState
from replicator.wire.messages import HeldStep, JobRef, NodeReport, extends, files_digest, in_lineage

log = logging.getLogger(__name__)

UNTRUSTED_CLAIMS = Counter(
    "mtc_coordinator_untrusted_claims_total",
    "Held-step claims ignored: from a node never assigned the rank nor ordered to hold it",
)

UNORDERED_SHARDS = Counter(
    "mtc_coordinator_unordered_shards_total",
    "Parity shard claims ignored: from a node not ordered to build that shard over that basis",
)


@dataclasses.dataclass
class Changes:
    """What a sync step changed: jobs to decide again, and jobs whose version moved (a rollback)."""

    dirty: set[JobRef] = dataclasses.field(default_factory=set)
    bumped: set[JobRef] = dataclasses.field(default_factory=set)


class WarnedOnce:
    """What was logged once: (node, job) untrusted claims and unordered shards, (job, step, rank) unknown owner
    checksums."""

    def __init__(self) -> None:
        self._seen: set[tuple[object, ...]] = set()

    def first(self, what: tuple[object, ...]) -> bool:
        if what in self._seen:
            return False
        self._seen.add(what)
        return True


def absorb(
    jobs: dict[JobRef, JobState],
    liveness: Liveness,
    node_id: str,
    bound: NodeState | None,
    report: NodeReport | None,
    warned: WarnedOnce,
) -> Changes:
    """Updates the job indices with what changed between the node's last report (``bound``) and
    ``report`` (None: the node is forgotten), and records the report as the node's."""
    changes = Changes()
    _pods(jobs, liveness, node_id, bound, report, changes, warned)
    if report is not None:
        _lineages(jobs, liveness, node_id, report, changes)
    held = _indexed(jobs, report.held if report else ())
    new_claims = frozenset(
        Claim(JobRef(h.namespace, h.job), h.step, h.rank, h.replica, h.timeline, h.content) for h in held
    )
    _claims(jobs, node_id, bound.claims if bound else frozenset(), held, new_claims, warned, changes)
    _owner_reports(jobs, liveness, node_id, held, changes)
    _listings(jobs, node_id, bound, report, changes)
    _shard_claims(jobs, node_id, bound, report, warned)
    if report is not None:
        stripped = tuple(msgspec.structs.replace(h, files=None) if h.files is not None else h for h in report.held)
        state = NodeState(
            msgspec.structs.replace(report, held=stripped), bound.last_seen if bound else liveness.now, new_claims
        )
        liveness.record(node_id, state, bound)
    return changes


def _pods(
    jobs: dict[JobRef, JobState],
    liveness: Liveness,
    node_id: str,
    bound: NodeState | None,
    report: NodeReport | None,
    changes: Changes,
    warned: WarnedOnce,
) -> None:
    """Pods unpublished from the node leave their job; new or changed ones join it (a job is
    created by its first pod), with the settings they carry. A pod stays filed under the live node
    that listed it first: a pod runs on one node for its life, so another node listing it too is
    lying, and neither takes it nor, by dropping it again, takes it out of its job."""
    old_pods = {p.pod_uid: p for p in bound.report.pods} if bound else {}
    new_pods = {p.pod_uid: p for p in report.pods} if report else {}
    for uid, pod in old_pods.items():
        key = JobRef(pod.namespace, pod.job)
        job = jobs.get(key)
        if uid not in new_pods and job is not None and job.pods.get(uid, (None, None))[1] == node_id:
            del job.pods[uid]
            job.retired_pods.discard(uid)  # a pod uid never comes back once its pod is gone
            job.pods_changed = True
            changes.dirty.add(key)
    for uid, pod in new_pods.items():
        if old_pods.get(uid) != pod:
            key = JobRef(pod.namespace, pod.job)
            job = jobs.get(key)
            if job is None:
                job = jobs[key] = JobState()
            filed = job.pods.get(uid)
            if filed is not None and filed[1] != node_id and liveness.is_live(filed[1]):
                if warned.first((node_id, "pod", uid)):
                    log.warning(
                        "node %s lists pod %s/%s (uid %s) of live node %s: ignored",
                        node_id,
                        pod.namespace,
                        pod.pod_name,
                        uid,
                        filed[1],
                    )
                continue
            job.pods[uid] = (pod, node_id)
            job.pods_changed = True
            if pod.settings is not None and pod.rank is not None and pod.rank not in job.settings:
                job.add_settings(pod.rank, pod.settings)
            changes.dirty.add(key)


def _lineages(
    jobs: dict[JobRef, JobState], liveness: Liveness, node_id: str, report: NodeReport, changes: Changes
) -> None:
    """Rollbacks the node reports that extend a job's: adopted if the job ran on the node (a
    lineage abandons data on every node of the job)."""
    for reported in report.lineages:
        key = JobRef(reported.namespace, reported.job)
        job = jobs.get(key)
        if job is not None and extends(reported.forks, job.forks) and node_id in job.beliefs.members:
            log.warning("job %s: node %s reports rollbacks to steps %s: adopting them", key, node_id, reported.forks)
            lineage.set_lineage(key, job, reported.forks, liveness.nodes)
            changes.bumped.add(key)


def _indexed(jobs: dict[JobRef, JobState], held: Iterable[HeldStep]) -> tuple[HeldStep, ...]:
    """The held steps to index: claims about a job no pod ever published are looked at again in the
    next report; copies of an abandoned timeline (or of one this coordinator has not learnt of
    yet) are not indexed."""
    kept = []
    for h in held:
        job = jobs.get(JobRef(h.namespace, h.job))
        if job is not None and in_lineage(job.forks, h.step, h.timeline):
            kept.append(h)
    return tuple(kept)


def _claims(
    jobs: dict[JobRef, JobState],
    node_id: str,
    old_claims: frozenset[Claim],
    held: tuple[HeldStep, ...],
    new_claims: frozenset[Claim],
    warned: WarnedOnce,
    changes: Changes,
) -> None:
    """Claims the node no longer makes are dropped (with what it reported of them); new ones are
    indexed, and a claim the coordinator does not believe is counted and logged once."""
    for claim in old_claims - new_claims:
        job = jobs.get(claim.job)
        if job is None:
            continue
        job.drop_claim(claim.step, claim.rank, node_id)
        job.owners.pending.pop((claim.step, claim.rank, node_id), None)
        changes.dirty.add(claim.job)
    for h in held:
        key = JobRef(h.namespace, h.job)
        if Claim(key, h.step, h.rank, h.replica, h.timeline, h.content) in old_claims:
            continue
        job = jobs[key]
        job.claims.add(h.step, h.rank, node_id, h.replica)
        changes.dirty.add(key)
        if job.incarnation is not None and not job.beliefs.believed(node_id, h.step, h.rank, h.replica):
            UNTRUSTED_CLAIMS.inc()
            if warned.first((node_id, key)):
                log.warning(
                    "job %s: ignoring node %s's claim to hold %s of rank %d step %d: not assigned or ordered",
                    key,
                    node_id,
                    "a replica" if h.replica else "the data",
                    h.rank,
                    h.step,
                )


def _owner_reports(
    jobs: dict[JobRef, JobState], liveness: Liveness, node_id: str, held: tuple[HeldStep, ...], changes: Changes
) -> None:
    """Checksums and signatures of the node's own data: other checksums from the node the incarnation runs the
    rank on supersede the step; new ones wait (``OwnerReports.pending``) until the node is believed."""
    for h in held:
        if h.replica:
            continue
        key = JobRef(h.namespace, h.job)
        job = jobs[key]
        owners = job.owners
        owner = owners.files.get((h.step, h.rank))
        packed = pack_files(h.files) if h.files is not None else None
        if packed is not None and owner is not None and packed != owner and job.beliefs.runs(node_id, h.rank):
            assert h.files is not None  # packed from them
            new = Claim(key, h.step, h.rank, True, h.timeline, files_digest(h.files))
            _supersede(key, job, node_id, new, liveness)
            changes.dirty.add(key)
        pending = owners.pending.get((h.step, h.rank, node_id))
        adds = (h.files is not None and (h.step, h.rank) not in owners.files) or (
            h.signature is not None and (h.step, h.rank) not in job.identity.signatures
        )
        if adds and (pending is None or (pending[0] is None and h.files is not None)):
            owners.pending[(h.step, h.rank, node_id)] = (packed, h.signature)
            changes.dirty.add(key)


def _supersede(key: JobRef, job: JobState, owner: str, new: Claim, liveness: Liveness) -> None:
    """The rank's own node reports other checksums for a step: the job wrote the step again (a
    restore to an older step had set it aside), or the node restored it from an identical
    data-parallel peer (other bytes). What the node holds is the rank's step from now on: the
    old checksums, signature and identities are forgotten, and the other nodes' copies (of the
    old bytes) stop counting until a node reports the step anew: a replica in other bytes (its
    ``content``) is a new claim. A node whose last report holds the new bytes already (``new``, a replica claim
    with the owner's new checksums' digest: a push of the rewritten step may reach it before its owner's report
    reaches the coordinator) keeps counting."""
    step, rank = new.step, new.rank
    log.warning(
        "job %s: rank %d's step %d now has other checksums (written again, or restored from a peer); "
        "copies of the old bytes no longer count",
        key,
        rank,
        step,
    )
    job.owners.drop(step, rank)
    job.identity.supersede(step, rank)
    old_bytes = [
        n
        for n in job.claims.of(step, rank)
        if n != owner and not (n in liveness.nodes and new in liveness.nodes[n].claims)
    ]
    for node_id in old_bytes:
        job.drop_claim(step, rank, node_id)  # still in the node's claims: indexed again only when reported anew
    job.rewritten.add(step)
    if job.backup_pending == step:
        log.warning("job %s: backup of step %d abandoned: ranks could upload different versions of it", key, step)
        job.backup_pending = None


def _shard_claims(
    jobs: dict[JobRef, JobState], node_id: str, bound: NodeState | None, report: NodeReport | None, warned: WarnedOnce
) -> None:
    """A forgotten node's parity orders go with it. A parity shard the node newly claims that no order backs
    (``ParityOrders.believed``) is counted and logged once; ``parity`` ignores it. Shards listed before the job
    has an incarnation (a restarted coordinator's first reports) wait for the orders of its round instead."""
    if report is None:
        for forgotten in jobs.values():
            forgotten.parity_orders.forget_node(node_id)
        return
    old = set(bound.report.shards) if bound else set()
    for shard in report.shards:
        key = JobRef(shard.namespace, shard.job)
        job = jobs.get(key)
        if shard in old or job is None or job.incarnation is None or job.parity_orders.believed(node_id, shard):
            continue
        UNORDERED_SHARDS.inc()
        if warned.first((node_id, key, "shard")):
            log.warning(
                "job %s: ignoring node %s's parity shard %d.%d of step %d, group %s: not ordered to build it "
                "over that basis (a restarted coordinator orders its round's step again)",
                key,
                node_id,
                shard.stripe,
                shard.index,
                shard.step,
                list(shard.members),
            )


def _listings(
    jobs: dict[JobRef, JobState], node_id: str, bound: NodeState | None, report: NodeReport | None, changes: Changes
) -> None:
    """The node's listings of jobs' backups; a forgotten node's listings go, and with each the job's listings older
    than it: they know less than it did, so none is believed until a node lists anew (a replan then waits for
    it instead of planning without the backups only the forgotten node had seen)."""
    if report is not None:
        old_listings = {JobRef(b.namespace, b.job): b for b in bound.report.backed_up} if bound else {}
        for listing in report.backed_up:
            key = JobRef(listing.namespace, listing.job)
            if old_listings.get(key) != listing and key in jobs:
                jobs[key].listings[node_id] = listing
                changes.dirty.add(key)
    elif bound is not None:
        for key in bound.job_keys():
            if (job := jobs.get(key)) is not None and (gone := job.listings.pop(node_id, None)) is not None:
                for older in [n for n, b in job.listings.items() if b.listed_at < gone.listed_at]:
                    del job.listings[older]
                changes.dirty.add(key)


def wants_files(jobs: dict[JobRef, JobState], report: NodeReport) -> bool:
    """Whether the coordinator lacks checksums of a step of the node's own data that ``report``
    left out (a restarted coordinator, or one that forgot them): the reply's ``want_files``."""
    for h in report.held:
        if h.replica or h.files is not None or (job := jobs.get(JobRef(h.namespace, h.job))) is None:
            continue
        if in_lineage(job.forks, h.step, h.timeline) and (h.step, h.rank) not in job.owners.files:
            pending = job.owners.pending.get((h.step, h.rank, report.node_id))
            if pending is None or pending[0] is None:
                return True
    return False
