"""The operator facade of ``ClusterState``: ``mtc status`` and ``mtc restore-from`` (its preview, its request,
its cancellation). The rollback's rules are ``replicator.coordinator.planning.rollbacks``."""

from replicator.coordinator.indices.job import JobState
from replicator.coordinator.planning import rollbacks, views
from replicator.coordinator.state.core import ClusterCore, UnknownJob
from replicator.wire.messages import JobRef
from replicator.wire.operator import ClusterStatus, RollbackPreview


class OperatorFacade:
    """An operator's calls (``GET /v1/status``, ``.../restore-from``): status, a rollback's preview, request and
    cancellation."""

    def __init__(self, core: ClusterCore):
        self._core = core

    def preview(self, key: JobRef, step: int) -> RollbackPreview:
        """What ``force_restore_step(key, step)`` would abandon (``rollbacks.preview``); changes nothing.

        Raises:
          UnknownJob; LookupError: no tier holds ``step`` complete for every rank.
        """
        return rollbacks.preview(key, self._known(key), step, self._core.copies(key), self._core.backed_up(key))

    def force(self, key: JobRef, step: int) -> None:
        """Makes the job's next restore use ``step`` (a rollback), from whichever tier holds it, also
        while the job has no pods. Cancellable until the restore is planned (``rollbacks.request``).

        Raises:
          UnknownJob; LookupError: no tier holds ``step`` complete for every rank.
        """
        rollbacks.request(key, self._known(key), step, self._core.copies(key))
        self._core.mark_dirty([key])

    def cancel(self, key: JobRef) -> int:
        """Withdraws the job's pending rollback (``rollbacks.cancel``); returns its step.

        Raises:
          UnknownJob; rollbacks.NotCancellable: none is pending, or its restore is planned.
        """
        step = rollbacks.cancel(key, self._known(key))
        self._core.mark_dirty([key])
        return step

    def status(self, keys: list[JobRef] | None = None) -> ClusterStatus:
        """Jobs (``keys``, else every one), their incarnation (rank -> node and pod), newest complete
        step, held steps, silent nodes, pending rollback, last backup and restore progress (``views``).

        Raises:
          UnknownJob: a job of ``keys`` is unknown.
        """
        for key in keys or ():
            self._known(key)
        silence = {n: self._core.liveness.silence(n) for n in self._core.liveness.silent()}
        jobs = []
        for key in sorted(self._core.jobs if keys is None else keys, key=lambda k: (k.namespace, k.job)):
            jobs.append(
                views.job_status(
                    key,
                    self._core.jobs[key],
                    self._core.copies(key),
                    self._core.newest_complete_step(key),
                    self._core.identical(key),
                    self._core.backed_up(key),
                    silence,
                    self._core.liveness.now,
                )
            )
        nodes = self._core.liveness.nodes
        return ClusterStatus(
            nodes=tuple(sorted(n for n in nodes if self._core.is_live(n))),
            silent_nodes=tuple(sorted(n for n in nodes if not self._core.is_live(n))),
            jobs=tuple(jobs),
            heartbeat_seconds=self._core.heartbeat_seconds,
        )

    def _known(self, key: JobRef) -> JobState:
        if key not in self._core.jobs:
            raise UnknownJob(f"no job {key}")
        return self._core.jobs[key]
