"""Views of a job: read-only answers about it (``JobView``, the façade's query API) and the status
view (``operator.JobStatus``) that ``GET /v1/status`` and ``mtc status`` show."""

from collections.abc import Mapping
from types import MappingProxyType

from replicator.coordinator import planner
from replicator.coordinator.indices.incarnations import Incarnation
from replicator.coordinator.indices.job import JobState, StandIn
from replicator.wire.messages import Files, JobRef, JobSettings, RetainOrder
from replicator.wire.operator import ExcludedCopy, JobStatus, RankPlace, RestoreStatus


class JobView:
    """Read-only answers about one job, as of the last report and decision pass
    (``ClusterState.job``): what the service and the tests ask, without reaching into its parts."""

    __slots__ = ("_job",)

    def __init__(self, job: JobState):
        self._job = job

    @property
    def incarnation(self) -> Incarnation | None:
        """The current incarnation (its ranks, pods and restore), or None."""
        return self._job.incarnation

    @property
    def settings(self) -> Mapping[int, JobSettings]:
        """Rank -> the settings its ``replicator.yaml`` carried (read-only, not copied)."""
        return MappingProxyType(self._job.settings)

    @property
    def retain(self) -> RetainOrder | None:
        """The standing retention order."""
        return self._job.decided.retain

    @property
    def replica_targets(self) -> Mapping[int, list[str]]:
        """Rank -> the nodes chosen to hold its replicas (read-only)."""
        return MappingProxyType(self._job.decided.targets)

    @property
    def lister(self) -> str | None:
        """The node that lists the job's backups."""
        return self._job.decided.lister

    @property
    def backup_pending(self) -> int | None:
        return self._job.backup_pending

    @property
    def backup_stand_ins(self) -> Mapping[int, StandIn]:
        """Rank -> who uploads the pending backup's copy of it in its lost node's place (read-only)."""
        return MappingProxyType(self._job.backup_stand_ins)

    @property
    def last_backup_time(self) -> float | None:
        return self._job.last_backup_time

    @property
    def forced_step(self) -> int | None:
        """The step an operator asked the next restore to use, until a restore to it completes."""
        return self._job.forced_step

    @property
    def forks(self) -> tuple[int, ...]:
        """The job's rollbacks (``messages.in_lineage``)."""
        return self._job.forks

    @property
    def undecided(self) -> bool:
        """Something of the job changed since its last decision pass."""
        return self._job.decided.dirty

    def owner_files(self, step: int, rank: int) -> Files | None:
        """The checksums the rank's own node reported for ``step``, or None."""
        return self._job.owners.checksums(step, rank)

    def claimed(self) -> dict[tuple[int, int], dict[str, bool]]:
        """(step, rank) -> {node: replica?}: every copy nodes claim, believed or not (a copy)."""
        return {k: dict(v) for k, v in self._job.claims.holders.items()}

    def ranks_claimed(self) -> dict[int, int]:
        """Step -> how many ranks some node claims a copy of (what a decision pass walks by)."""
        return dict(self._job.claims.step_ranks)


def job_status(
    key: JobRef,
    job: JobState,
    copies: list[planner.StepCopy],
    newest_complete: int | None,
    identical: Mapping[int, frozenset[tuple[int, int]]],
    backups: set[int],
    silence: Mapping[str, float],
    now: float,
) -> JobStatus:
    """The job's incarnation (rank -> node and pod), its restore, the copies held and its decisions.

    Args:
      copies: every believed copy (restore sources) and complete backup.
      identical: step -> pairs of ranks found identical (``Identity.pairs``).
      backups: the complete backups of the lineage.
      silence: the silent nodes of the cluster -> seconds since each last reported.
      now: unix seconds, for the last backup's age.
    """
    incarnation = job.incarnation
    job_nodes = incarnation.nodes if incarnation else {node for _, node in job.pods.values()}
    last_backup = max(backups, default=None)
    seen = job.backup_seen.get(last_backup) if last_backup is not None else None
    return JobStatus(
        namespace=key.namespace,
        job=key.job,
        incarnation=incarnation.incarnation_id if incarnation else None,
        waiting_pods=0 if incarnation else len(job.pods),
        ranks=_rank_places(job, incarnation, silence),
        newest_complete_step=newest_complete,
        restore=_restore_status(incarnation),
        held=_held(copies),
        identical_peers=tuple(sorted(identical.get(newest_complete, ()) if newest_complete is not None else ())),
        safe_step=job.decided.safe,
        backups=tuple(sorted(backups)),
        backup_pending=job.backup_pending,
        backup_lister=job.decided.lister,
        forced_step=job.forced_step,
        timeline=len(job.forks),
        rollbacks=job.forks,
        silent_nodes={n: round(s, 1) for n, s in sorted(silence.items()) if n in job_nodes},
        pending_rollback=job.pending_rollback(),
        last_backup_step=last_backup,
        last_backup_age_seconds=None if seen is None else round(max(0.0, now - seen), 1),
    )


def _rank_places(job: JobState, incarnation: Incarnation | None, silence: Mapping[str, float]) -> tuple[RankPlace, ...]:
    """The incarnation's ranks in order, each with its node, its pod and whether the node is silent."""
    ranks = []
    if incarnation:
        for uid, rank in sorted(incarnation.rank_of_pod.items(), key=lambda item: item[1]):
            node = incarnation.node_of_rank[rank]
            ranks.append(RankPlace(rank, node, job.pods[uid][0].pod_name, node in silence))
    return tuple(ranks)


def _restore_status(incarnation: Incarnation | None) -> RestoreStatus | None:
    """The incarnation's restore (its step, sources used, copies excluded, ranks staged), or None before its plan."""
    if incarnation is None or incarnation.plan is None:
        return None
    return RestoreStatus(
        incarnation.plan.step,
        dict(sorted(incarnation.used_sources.items())),
        tuple(ExcludedCopy(*c) for c in sorted(incarnation.excluded)),
        len(incarnation.staged),
        len(incarnation.node_of_rank),
    )


def _held(copies: list[planner.StepCopy]) -> dict[int, dict[int, tuple[str, ...]]]:
    """Rank -> step -> the holders of its copies, every level sorted."""
    held: dict[int, dict[int, list[str]]] = {}
    for copy in copies:
        held.setdefault(copy.rank, {}).setdefault(copy.step, []).append(copy.holder)
    return {rank: {step: tuple(sorted(h)) for step, h in sorted(steps.items())} for rank, steps in sorted(held.items())}
