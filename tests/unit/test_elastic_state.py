"""An elastic restore through the coordinator's state machine: a torchrun job saved on 2 nodes comes back on 3; the
plan names both old nodes' copies per new node, the job forks a timeline at the step, and the old shape's steps stay
unsafe (GC keeps them) until a step of the new shape is safe."""

import pytest

from replicator.coordinator.state import ClusterState, decide_interval
from replicator.wire.messages import HeldStep, JobRef, JobSettings, PodReport
from tests.helpers.reports import node_report, pod_report

pytestmark = pytest.mark.unit

KEY = JobRef("default", "tr")
SETTINGS = JobSettings((), 1, 30.0, None)
TORCH_FILES = {"rank-0-of-2/.metadata": (10, "00000001"), "rank-1-of-2/.metadata": (10, "00000002")}


def pod(node: int, nodes: int, generation: int, incarnation=None, rank=None) -> PodReport:
    return pod_report(
        KEY, 0, node, f"uid-{generation}-{node}", incarnation, rank, SETTINGS if rank is not None else None,
        nodes=nodes, ranks_follow_data=False, published_at=float(generation),
    )  # fmt: skip


def held(step: int, rank: int, replica: bool = False, timeline: int = 0) -> HeldStep:
    return HeldStep(KEY.namespace, KEY.job, step, rank, None if replica else TORCH_FILES, replica, timeline=timeline)


def run(state: ClusterState, nodes: int, generation: int, now: float, steps) -> dict[int, str]:
    """The job's pods of ``generation`` on nodes 0..nodes-1 form an incarnation; each node then reports ``steps(node)``.
    Returns rank -> node."""
    for node in range(nodes):  # a node that held steps still reports them
        mine, kept = [pod(node, nodes, generation)], steps(node) if generation > 1 else ()
        state.apply_report(node_report(f"n{node}", mine, kept, topology={"block": "b0"}), now)
    state.tick(now + decide_interval(nodes))
    incarnation = state.job(KEY).incarnation
    assert incarnation is not None and len(incarnation.node_of_rank) == nodes
    for rank in incarnation.node_of_rank:
        state.restore.settings(KEY, incarnation.incarnation_id, rank, SETTINGS)
    for at in (now, now + 1):  # a new job's own steps first: a replica counts once a decision pass ordered it
        for rank, node in incarnation.node_of_rank.items():
            mine = [pod(int(node[1:]), nodes, generation, incarnation.incarnation_id, rank)]
            reported = [h for h in steps(int(node[1:])) if at > now or not h.replica or generation > 1]
            state.apply_report(node_report(node, mine, reported, topology={"block": "b0"}), at)
        state.tick(at + 0.5)
    return dict(incarnation.node_of_rank)


def test_a_job_saved_on_2_nodes_restores_on_3_resharded_in_a_timeline_of_its_own_and_keeps_the_old_steps():
    state = ClusterState()
    state.expire(0.0)
    # Step 10 of 2 nodes: each node its own copy and the other's replica.
    run(state, 2, 1, 0.0, lambda n: (held(10, n), held(10, 1 - n, replica=True)))
    assert state.safe_step(KEY) == 10
    for node in range(2):  # the pods go
        state.apply_report(node_report(f"n{node}", [], (held(10, node), held(10, 1 - node, True))), 100.0)
    node_of_rank = run(state, 3, 2, 100.0, lambda n: (held(10, n), held(10, 1 - n, True)) if n < 2 else ())
    incarnation = state.job(KEY).incarnation.incarnation_id

    views = {rank: state.restore.view(KEY, incarnation, rank, 102.0) for rank in node_of_rank}
    assert {v.step for v in views.values()} == {10} and {v.saved_nodes for v in views.values()} == {2}
    assert [(s.data_rank, s.tier, s.holder) for s in views[2].sources] == [
        (0, "peer_close", "n0"),
        (0, "peer_close", "n1"),
        (1, "peer_close", "n0"),
        (1, "peer_close", "n1"),
    ]
    assert [(s.data_rank, s.tier) for s in views[0].sources][::2] == [(0, "local"), (1, "local")]
    assert all(s.files == TORCH_FILES for v in views.values() for s in v.sources)  # each old node's own checksums
    assert views[0].forks == (10,)  # the new shape trains in a timeline of its own from step 10
    state.tick(104.0)
    assert state.safe_step(KEY) is None  # step 10 is the old shape's: GC keeps it whole

    # The new shape's step 13, replicated: safe, and the old shape's steps may go.
    for at in (106.0, 107.0):
        for rank, node in node_of_rank.items():
            index = int(node[1:])
            steps = [held(13, rank, timeline=1)] + [held(13, (rank - 1) % 3, True, 1)] * (at > 106.0)
            steps += [held(10, index), held(10, 1 - index, True)] if index < 2 else []
            mine = [pod(index, 3, 2, incarnation, rank)]
            state.apply_report(node_report(node, mine, steps, topology={"block": "b0"}), at)
        state.tick(at + 0.5)
    assert state.safe_step(KEY) == 13


def test_after_a_node_loss_with_no_spare_the_old_shapes_steps_are_not_safe_on_the_one_node_left():
    state = ClusterState()
    state.expire(0.0)
    run(state, 2, 1, 0.0, lambda n: (held(7, n), held(7, 1 - n, True), held(10, n), held(10, 1 - n, True)))
    assert state.safe_step(KEY) == 10
    state.apply_report(node_report("n0", [], (held(10, 0), held(10, 1, True))), 100.0)
    node_of_rank = run(state, 1, 2, 100.0, lambda n: (held(7, 0), held(7, 1, True), held(10, 0), held(10, 1, True)))
    view = state.restore.view(KEY, state.job(KEY).incarnation.incarnation_id, 0, 102.0)
    assert node_of_rank == {0: "n0"} and (view.step, view.saved_nodes) == (10, 2)
    # n1 is lost: its own copy of rank 1 and its replica of rank 0 serve no more; n0 holds both old nodes' data.
    assert [(s.data_rank, s.tier, s.holder) for s in view.sources] == [(0, "local", "n0"), (1, "local", "n0")]
    state.tick(104.0)
    # Rank 0 alone is held twice at steps 7 and 10, but they are the old shape's: GC keeps both nodes' data of both.
    assert state.safe_step(KEY) is None
