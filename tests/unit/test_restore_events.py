"""The coordinator's restore events (replicator/coordinator/kube/restore_events.py), read off a real ``ClusterState`` as
its restores plan, stage, fall back and roll back; the objects each names; and the JobSet's annotations
(replicator/coordinator/kube/jobset_annotations.py) read off the same state."""

from replicator.coordinator.indices.incarnations import Incarnation
from replicator.coordinator.kube.jobset_annotations import BACKED_UP_STEP, RESTORING, SAFE_STEP, annotations_of
from replicator.coordinator.kube.kube_events import EventType, ObjectRef
from replicator.coordinator.kube.kube_shape import JobShape, PodPlace
from replicator.coordinator.kube.restore_events import JOBSET_API_VERSION, RestoreEvents, objects_of
from replicator.coordinator.state import ClusterState
from tests.helpers.coordinator import KEY, running_job
from tests.unit.test_cluster_state import rolled_back_to_2


def _seen(events: RestoreEvents, state: ClusterState, now: float) -> list[tuple[int | None, EventType, str, str]]:
    return [(h.rank, h.type, h.reason, h.message) for h in events.observe(state, now)]


def test_a_restore_starts_once_and_is_done_when_every_rank_staged_with_its_seconds():
    state, events = ClusterState(), RestoreEvents(recorder=None)  # observe sends nothing
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    view = state.restore.view(KEY, incarnation, rank_of["a"], now=20.5)
    assert _seen(events, state, 20.5) == [
        (None, EventType.NORMAL, "RestoreStarted", "restore of step 5 for 2 ranks, 20 B, from local x2")
    ]
    assert _seen(events, state, 20.75) == []  # nothing new: nothing sent again
    state.restore.staged(KEY, incarnation, view.generation, rank_of["a"], "local:a", [])
    assert _seen(events, state, 21.0) == []
    state.restore.staged(KEY, incarnation, view.generation, rank_of["b"], "local:b", [])
    assert _seen(events, state, 23.0) == [
        (None, EventType.NORMAL, "RestoreDone", "step 5 restored by 2 ranks in 2.5 s from local x2")
    ]
    assert _seen(events, state, 24.0) == []


def test_a_rank_staged_from_another_tier_and_a_replan_after_a_bad_copy_are_fallbacks():
    state, events = ClusterState(), RestoreEvents(recorder=None)
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    rank = rank_of["b"]
    view = state.restore.view(KEY, incarnation, rank, now=20.5)
    events.observe(state, 20.5)
    state.restore.staged(KEY, incarnation, view.generation, rank, None, [(5, rank, "b")])  # b's own copy is bad
    replanned = state.restore.view(KEY, incarnation, rank, now=21.0)
    assert replanned.generation != view.generation
    [(who, kind, reason, message)] = _seen(events, state, 21.0)
    assert (who, kind, reason) == (None, EventType.WARNING, "RestoreFellBack")
    assert message.startswith(f"restore replanned after unusable copies [(5, {rank}, 'b')]: now step 5 from ")
    state.restore.staged(KEY, incarnation, replanned.generation, rank, "peer_distant:a", [])
    assert _seen(events, state, 21.5) == []  # the replan planned the peer first: no fallback of the rank
    # A rank that staged from a later source than its first is one.
    plan = state.job(KEY).incarnation.plan
    first = plan.sources[rank_of["a"]][0]
    state.restore.staged(KEY, incarnation, replanned.generation, rank_of["a"], "backup:backup", [])
    found = _seen(events, state, 22.0)
    assert found[0] == (
        rank_of["a"],
        EventType.WARNING,
        "RestoreFellBack",
        f"rank {rank_of['a']} restored step 5 from backup:backup, not from its first source {first.tier}:{first.holder}",
    )
    assert [f[2] for f in found[1:]] == ["RestoreDone"]


def test_a_rollback_is_announced_as_such_and_ends_rolled_back():
    state, events = ClusterState(), RestoreEvents(recorder=None)
    rank_of, fresh, view = rolled_back_to_2(state, (2,))
    [(_, _, reason, message)] = _seen(events, state, 22.5)
    assert (reason, message) == ("RestoreStarted", "rollback to step 2 for 2 ranks, 20 B, from local x2")
    node_of = {rank: node for node, rank in rank_of.items()}
    for rank in (0, 1):
        state.restore.staged(KEY, fresh, view.generation, rank, f"local:{node_of[rank]}", [])
    assert _seen(events, state, 30.5) == [
        (None, EventType.NORMAL, "RolledBack", "rolled back to step 2: every rank restored it in 8.0 s from local x2")
    ]


def _place(name: str, node: str, worker: int) -> PodPlace:
    return PodPlace(name, f"uid-{name}", 0, worker, None, None, node, None)


def test_objects_are_the_jobset_and_rank_0s_pod_for_the_job_and_the_ranks_pod_for_a_rank():
    shape = JobShape(KEY, "llama", "js-uid", ("slice",), 2, 1, 2, (_place("p0", "n0", 0), _place("p1", "n1", 1)))
    incarnation = Incarnation("inc", {"uid-p1": 0, "uid-p0": 1}, {0: "n1", 1: "n0"})
    jobset = ObjectRef("JobSet", JOBSET_API_VERSION, KEY.namespace, "llama", "js-uid")
    assert objects_of(shape, incarnation, None) == [jobset, ObjectRef("Pod", "v1", KEY.namespace, "p1", "uid-p1")]
    assert objects_of(shape, incarnation, 1) == [ObjectRef("Pod", "v1", KEY.namespace, "p0", "uid-p0")]
    assert objects_of(shape, Incarnation("inc", {"uid-p1": 0}, {0: "elsewhere"}), 0) == []


def test_jobset_annotations_carry_the_safe_and_backed_up_steps_and_restoring_while_ranks_stage():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    assert annotations_of(state, KEY)[RESTORING] == "false"  # no restore planned yet
    view = state.restore.view(KEY, incarnation, rank_of["a"], now=20.5)
    # Step 5 held by each rank and replicated to the other node: safe; no backup tier.
    assert annotations_of(state, KEY) == {SAFE_STEP: "5", BACKED_UP_STEP: None, RESTORING: "true"}
    for node in ("a", "b"):
        state.restore.staged(KEY, incarnation, view.generation, rank_of[node], f"local:{node}", [])
    assert annotations_of(state, KEY)[RESTORING] == "false"
