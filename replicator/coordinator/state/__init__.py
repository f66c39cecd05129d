"""The coordinator's soft state: rebuilt from node reports, so a coordinator restart loses nothing.

``ClusterState`` is the core (``core.ClusterCore``: jobs, liveness, versions, dirty marks, the sync step, the
decision pass, queries) with a facade per caller: ``restore`` (``restore.RestoreFacade``: a rank's settings, its
restore view, its staging result) and ``operator`` (``operator.OperatorFacade``: status, a rollback's preview,
request and cancellation). Only the core bumps versions and marks jobs to decide again.
"""

from replicator.coordinator.indices.incarnations import UnknownIncarnation
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.planning import recovery
from replicator.coordinator.planning.restores import PEER_SOURCES_PER_VIEW, USABLE_TIERS, NotReady
from replicator.coordinator.state.core import ClusterCore, NodeIdTaken, UnknownJob, decide_interval
from replicator.coordinator.state.operator import OperatorFacade
from replicator.coordinator.state.restore import RestoreFacade
from replicator.wire.messages import JobRef

__all__ = [
    "PEER_SOURCES_PER_VIEW",
    "USABLE_TIERS",
    "ClusterState",
    "NodeIdTaken",
    "NotReady",
    "UnknownIncarnation",
    "UnknownJob",
    "decide_interval",
]


class ClusterState(ClusterCore):
    """The coordinator's state: the core (``ClusterCore``, the sync step's and the decision pass's API) and its
    facades by caller, ``restore`` (``RestoreFacade``) and ``operator`` (``OperatorFacade``), and what the state dir
    keeps for a restart (``recovery``; ``api.recovery_snapshot`` writes and reads it). Arguments as ``ClusterCore``'s."""

    def __init__(
        self,
        node_timeout_seconds: float = 15.0,
        holder_grace_seconds: float = 60.0,
        fan_out: bool = True,
        shared_backup: bool = False,
    ):
        super().__init__(node_timeout_seconds, holder_grace_seconds, fan_out, shared_backup)
        self.restore = RestoreFacade(self)
        self.operator = OperatorFacade(self)

    def recovery_stamp(self) -> tuple[object, ...]:
        """Changes whenever what ``recovery_records`` answers may have changed; cheap."""
        return tuple((key, recovery.stamp(job)) for key, job in self.jobs.items())

    def recovery_records(self) -> list[recovery.JobRecovery]:
        """What a restarted coordinator cannot learn again from reports, per job that has any."""
        return [found for key, job in self.jobs.items() if (found := recovery.record(key, job)) is not None]

    def recover(self, recovered: recovery.JobRecovery) -> None:
        """Takes in what a previous coordinator kept of a job (``recovery.check``ed), before its reports arrive."""
        recovery.apply(self.jobs.setdefault(JobRef(recovered.namespace, recovered.job), JobState()), recovered)
