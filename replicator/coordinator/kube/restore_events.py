"""What the coordinator's restores did, as Kubernetes Events on the training pods and their JobSet (``--kube``).

``RestoreEvents.observe`` runs after each tick's decision pass and compares every job's incarnation with what it
saw the tick before, as a controller compares observed state; it changes nothing in the state, so the decision code
knows nothing of events. What it finds:

============================  =======  ===========================================================================
reason                        type     when, and on what
============================  =======  ===========================================================================
``RestoreStarted``            Normal   a restore plan of a step: its step, ranks, bytes and source tiers (JobSet,
                                       rank 0's pod)
``RestoreFellBack``           Warning  a rank staged from another tier than planned first (its pod), or the plan
                                       was replaced after unusable copies (JobSet, rank 0's pod)
``RestoreDone``               Normal   every rank staged the step: seconds since the plan was seen, the tiers used
                                       (JobSet, rank 0's pod)
``RolledBack``                Normal   the same for an operator's ``mtc restore-from`` step (JobSet, rank 0's pod)
============================  =======  ===========================================================================

Events go through ``kube_events.EventRecorder`` (client-go's correlation). A job with no shape from the API server
(not a JobSet's) has no objects to name: its events are dropped.
"""

import collections
import dataclasses
import time

from replicator.coordinator.indices.incarnations import Incarnation
from replicator.coordinator.kube.kube_events import EventRecorder, EventType, ObjectRef
from replicator.coordinator.kube.kube_shape import JobShape, Shapes
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import JobRef

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"


@dataclasses.dataclass
class _Seen:
    """One job's restore as the previous tick saw it."""

    incarnation_id: str
    generation: str
    planned_at: float
    staged: set[int]
    done: bool = False


@dataclasses.dataclass(frozen=True)
class Happening:
    """An event about a job before it names objects: ``rank`` None for the whole job, else that rank's pod."""

    job: JobRef
    rank: int | None
    type: EventType
    reason: str
    message: str


def _tiers(incarnation: Incarnation, used: bool = False) -> str:
    """``local x3, peer_close x1``: each rank's first planned source tier (``used``: the tier it staged from),
    counted."""
    assert incarnation.plan is not None
    if used:
        tiers = [source.partition(":")[0] for source in incarnation.used_sources.values()]
    else:
        tiers = [str(sources[0].tier) for sources in incarnation.plan.sources.values() if sources]
    counts = collections.Counter(tiers)
    return ", ".join(f"{tier} x{n}" for tier, n in sorted(counts.items())) or "none"


def _size(size: int) -> str:
    """Bytes as a person reads them: ``1.50 GiB``, ``20.0 MiB``, ``512 B``."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} B"


class RestoreEvents:
    """Finds each job's restore events between ticks (``observe``) and sends them (``publish``)."""

    def __init__(self, recorder: EventRecorder):
        self._recorder = recorder
        self._seen: dict[JobRef, _Seen] = {}

    def publish(self, state: ClusterState, shapes: Shapes, now: float | None = None) -> None:
        """Observes ``state`` and records each happening on its objects in ``shapes``."""
        for happening in self.observe(state, time.time() if now is None else now):
            shape = shapes.jobs.get(happening.job)
            incarnation = state.job(happening.job).incarnation
            if shape is None or incarnation is None:
                continue
            for ref in objects_of(shape, incarnation, happening.rank):
                self._recorder.record(ref, happening.type, happening.reason, happening.message)

    def observe(self, state: ClusterState, now: float) -> list[Happening]:
        """What changed in every job's restore since the last call."""
        found: list[Happening] = []
        keys = state.job_keys()
        for key in keys:
            view = state.job(key)
            incarnation = view.incarnation
            if incarnation is None or incarnation.plan is None or incarnation.plan.step is None:
                continue
            seen = self._seen.get(key)
            if seen is None or seen.incarnation_id != incarnation.incarnation_id:
                seen = self._started(key, state, incarnation, now, found)
            elif seen.generation != incarnation.generation:
                found.append(
                    Happening(
                        key,
                        None,
                        EventType.WARNING,
                        "RestoreFellBack",
                        f"restore replanned after unusable copies {sorted(incarnation.excluded)}: now step "
                        f"{incarnation.plan.step} from {_tiers(incarnation)}",
                    )
                )
                seen = self._started(key, state, incarnation, now, found, announce=False)
            self._staged(key, incarnation, seen, now, found)
        for gone in self._seen.keys() - set(keys):
            del self._seen[gone]
        return found

    def _started(
        self,
        key: JobRef,
        state: ClusterState,
        incarnation: Incarnation,
        now: float,
        found: list[Happening],
        announce: bool = True,
    ) -> _Seen:
        plan = incarnation.plan
        assert plan is not None and plan.step is not None
        if announce:
            files = [state.job(key).owner_files(plan.step, rank) for rank in plan.sources]
            size = sum(s for f in files if f for s, _ in f.values())
            what = "rollback to step" if incarnation.rollback else "restore of step"
            found.append(
                Happening(
                    key,
                    None,
                    EventType.NORMAL,
                    "RestoreStarted",
                    f"{what} {plan.step} for {len(incarnation.node_of_rank)} ranks, {_size(size)}, from "
                    f"{_tiers(incarnation)}",
                )
            )
        seen = _Seen(incarnation.incarnation_id, incarnation.generation, now, set())
        self._seen[key] = seen
        return seen

    def _staged(self, key: JobRef, incarnation: Incarnation, seen: _Seen, now: float, found: list[Happening]) -> None:
        plan = incarnation.plan
        assert plan is not None
        for rank in sorted(incarnation.staged - seen.staged):
            used, planned = incarnation.used_sources.get(rank, ""), plan.sources.get(rank, ())
            if planned and not used.startswith(f"{planned[0].tier}:"):
                found.append(
                    Happening(
                        key,
                        rank,
                        EventType.WARNING,
                        "RestoreFellBack",
                        f"rank {rank} restored step {plan.step} from {used or 'nowhere'}, not from its first "
                        f"source {planned[0].tier}:{planned[0].holder}",
                    )
                )
        seen.staged = set(incarnation.staged)
        if not seen.done and len(incarnation.staged) == len(incarnation.node_of_rank):
            seen.done = True
            seconds = now - seen.planned_at
            if incarnation.rollback:
                message = f"rolled back to step {plan.step}: every rank restored it in {seconds:.1f} s"
                message += f" from {_tiers(incarnation, used=True)}"
                found.append(Happening(key, None, EventType.NORMAL, "RolledBack", message))
            else:
                message = f"step {plan.step} restored by {len(incarnation.staged)} ranks in {seconds:.1f} s"
                message += f" from {_tiers(incarnation, used=True)}"
                found.append(Happening(key, None, EventType.NORMAL, "RestoreDone", message))


def objects_of(shape: JobShape, incarnation: Incarnation, rank: int | None) -> list[ObjectRef]:
    """The objects an event names: the JobSet and rank 0's pod for the whole job (``rank`` None), else the rank's
    pod (found by its node: one pod of a job per node)."""
    node = incarnation.node_of_rank.get(0 if rank is None else rank)
    namespace = shape.job.namespace
    pods = [ObjectRef("Pod", "v1", namespace, p.name, p.uid) for p in shape.pods if p.node == node and node]
    if rank is not None:
        return pods[:1]
    return [ObjectRef("JobSet", JOBSET_API_VERSION, namespace, shape.jobset, shape.jobset_uid), *pods[:1]]
