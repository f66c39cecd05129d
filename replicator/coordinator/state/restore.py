"""The restore facade of ``ClusterState``: what a restoring rank's calls change and read (``restore``: its settings,
its view of the job's plan, its staging result). The plan itself is ``replicator.coordinator.planning.restores``."""

import logging

from replicator.coordinator import planner
from replicator.coordinator.copies import backups, retention
from replicator.coordinator.indices import lineage
from replicator.coordinator.indices.incarnations import Incarnation, UnknownIncarnation
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.planning import elastic, restores
from replicator.coordinator.state.core import ClusterCore
from replicator.wire.messages import BadCopy, JobRef, JobSettings, RestoreView

log = logging.getLogger(__name__)

# How long a restore waits for the nodes' first listing of the backup tier before planning without it.
_BACKUP_LISTING_GRACE_SECONDS = 60.0


class RestoreFacade:
    """A restoring rank's calls (the routes under ``/v1/jobs/.../restore``): its settings, its restore view,
    its staging result; the replans they cause. Every change goes through the core, which bumps versions."""

    def __init__(self, core: ClusterCore):
        self._core = core

    def touch_rank(self, key: JobRef, incarnation_id: str, rank: int, now: float) -> None:
        """The node of ``rank`` is alive at ``now``: it is asking for its restore (a long poll that
        can outlast a heartbeat interval, and may hold the agent's only connection).

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        self._core.touch(self.node_of_rank(key, incarnation_id, rank), now)

    def settings(self, key: JobRef, incarnation_id: str, rank: int, settings: JobSettings) -> None:
        """Stores the settings a rank's ``replicator.yaml`` carried.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        self._incarnation(key, incarnation_id, rank)
        self._core.jobs[key].add_settings(rank, settings)
        self._core.decide_if_due(key)

    def settings_from_snapshot(self, key: JobRef, rank: int, settings: JobSettings) -> None:
        """A rank's settings from a snapshot of a previous coordinator (no incarnation needed)."""
        job = self._core.jobs.get(key)
        if job is None:
            job = self._core.jobs[key] = JobState()
        job.add_settings(rank, settings)

    def view(self, key: JobRef, incarnation_id: str, rank: int, now: float) -> RestoreView:
        """The plan for ``rank``, frozen for the incarnation at the first request.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
          NotReady: the job's nodes with a backup tier have not listed it yet (for up to 60 s):
            planning without it could start a job from scratch that a backup would have resumed.
            Or the coordinator started less than a node timeout ago: a holder that has not reported
            yet would make the plan choose an older step.
        """
        self._core.liveness.advance(now)
        incarnation = self._incarnation(key, incarnation_id, rank)
        job = self._core.jobs[key]
        restores.check_started(incarnation, self._core.liveness, now)
        if restores.replan_helps(job, incarnation, rank, self._core.liveness, lambda: self._plan_inputs(key)):
            assert incarnation.plan is not None  # only a plan's sources are lost
            log.warning(
                "job %s rank %d: no source of step %d left but lost, given up or unusable ones; replanning",
                key,
                rank,
                incarnation.plan.step,
            )
            self._replan(key, incarnation)
        if incarnation.plan is None:
            # Plan on every report that has arrived, but decide a large job at most every
            # ``decide_interval``: its N ranks asking at once must not cost N decision passes.
            if job.decided.dirty:
                self._core.decide_if_due(key)
            restores.check_plannable(job, incarnation, self._core.liveness.nodes, now, _BACKUP_LISTING_GRACE_SECONDS)
            self._replan(key, incarnation)
        return restores.view(
            key,
            job,
            incarnation,
            rank,
            self._core.liveness,
            backups.complete(job, self._core.liveness.nodes),
            self._core.warned,
        )

    def _plan_inputs(self, key: JobRef) -> restores.PlanInputs:
        """What the job's restore plan reads now (``restores.PlanInputs``). A step saved at another node
        count that the job can reshard (``elastic.saved_shapes``) is backed up for its own ranks."""
        job = self._core.jobs[key]
        identical, silent = job.identity.pairs(), frozenset(self._core.liveness.silent())
        shapes = elastic.saved_shapes(job, job.ranks()) if elastic.reshards(job) else {}
        if not shapes:
            return restores.PlanInputs(
                self._core.copies(key), self._core.liveness.blocks, identical, self._core.fan_out, silent
            )
        copies = self._core.copies(key, with_backups=False) + [
            planner.StepCopy.backed_up(step, rank)
            for step in self._core.backed_up(key)
            for rank in range(shapes.get(step, job.ranks()))
        ]
        return restores.PlanInputs(copies, self._core.liveness.blocks, identical, self._core.fan_out, silent, shapes)

    def _replan(self, key: JobRef, incarnation: Incarnation) -> None:
        job = self._core.jobs[key]
        # The inputs are gathered again after a fork: the copies of the timeline it abandons are not copies any more.
        pending = job.pending_rollback() is not None
        if pending and (forks := restores.begin_rollback(key, job, incarnation, self._plan_inputs(key))) is not None:
            self._set_lineage(key, forks)  # a rollback starts a new timeline
        restores.replan(key, job, incarnation, self._plan_inputs(key))
        if (plan := incarnation.plan) is not None and plan.saved_nodes is not None and job.forks[-1:] != (plan.step,):
            # The new shape trains in a timeline of its own from the resharded step: a copy of a newer step
            # of the old shape (a holder that comes back) is never taken for one of the new shape's.
            assert plan.step is not None  # an elastic plan restores a step
            self._set_lineage(key, (*job.forks, plan.step))
            restores.replan(key, job, incarnation, self._plan_inputs(key))
        job.decided.retain = retention.retain_order(key, job)  # the planned step is protected from now on
        self._core.bump(key)

    def staged(
        self,
        key: JobRef,
        incarnation_id: str,
        generation: str,
        rank: int,
        source: str | None,
        bad: tuple[BadCopy, ...] = (),
        retrying: bool = False,
    ) -> None:
        """Records a rank's staging result (``restores.record_staged``). Only a rank left with no
        source but proven-unusable ones replans the whole job, to an older step if need be.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        incarnation = self._incarnation(key, incarnation_id, rank)
        outcome = restores.record_staged(key, incarnation, generation, rank, source, bad, retrying)
        if outcome is restores.StagingOutcome.READY:
            restores.end_rollback(self._core.jobs[key], incarnation)
        if outcome in (restores.StagingOutcome.READY, restores.StagingOutcome.SERVING):
            self._core.bump(key)  # every rank's view turns ready, or a downloader's peers may fetch from it
        elif outcome is restores.StagingOutcome.REPLAN:
            self._replan(key, incarnation)

    def node_of_rank(self, key: JobRef, incarnation_id: str, rank: int) -> str:
        """The node ``rank`` of the incarnation runs on.

        Raises:
          UnknownIncarnation: the incarnation or rank is not current.
        """
        return self._incarnation(key, incarnation_id, rank).node_of_rank[rank]

    def _set_lineage(self, key: JobRef, forks: tuple[int, ...]) -> None:
        lineage.set_lineage(key, self._core.jobs[key], forks, self._core.liveness.nodes)
        self._core.bump(key)

    def _incarnation(self, key: JobRef, incarnation_id: str, rank: int) -> Incarnation:
        job = self._core.jobs.get(key)
        incarnation = job.incarnation if job else None
        if incarnation is None or incarnation.incarnation_id != incarnation_id or rank not in incarnation.node_of_rank:
            raise UnknownIncarnation(f"job {key} has no current incarnation {incarnation_id} with rank {rank}")
        return incarnation
