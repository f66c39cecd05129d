"""The coordinator's trust decisions as pure functions of reports and time (no HTTP, no processes)."""

import pytest

from replicator.cluster_state import ClusterState, NodeIdTaken
from replicator.messages import HeldStep, JobSettings, NodeReport, PodReport

KEY = ("default", "run")
OWN = {0: {"state/a": (10, "00000001")}, 1: {"state/b": (10, "00000002")}}
SETTINGS = JobSettings((), 1, None, 1)


def pod(index, incarnation=None, rank=None):
    return PodReport("default", "run", f"run-0-{index}-x", f"uid{index}", 0, index, 2, 1, 8476, "run", 0.0, incarnation, rank,
                     SETTINGS if rank is not None else None)  # fmt: skip


def report(node, url, pods=(), held=()):
    return NodeReport(node, url, "127.0.0.1", {"block": node}, tuple(pods), tuple(held))


def running_job(state: ClusterState, now=0.0):
    """Nodes a and b run the two ranks of a DP=1 job; each holds its own step 5 and the other's
    replica. Node a's replica does not match what the rank's own node (b) reported."""
    state.apply_report(report("a", "http://a", [pod(0)]), now)
    incarnation = state.apply_report(report("b", "http://b", [pod(1)]), now).assignments[0].incarnation
    rank_of_pod = state.jobs[KEY].incarnation.rank_of_pod
    rank_of = {"a": rank_of_pod["uid0"], "b": rank_of_pod["uid1"]}
    for node in ("a", "b"):
        state.record_settings(KEY, incarnation, rank_of[node], SETTINGS)
    for index, (node, other) in enumerate((("a", "b"), ("b", "a"))):
        mine, theirs = rank_of[node], rank_of[other]
        replica = {path: (size, "0000bad0") for path, (size, _) in OWN[theirs].items()} if node == "a" else OWN[theirs]
        held = [HeldStep(*KEY, 5, mine, OWN[mine]), HeldStep(*KEY, 5, theirs, replica, replica=True)]
        state.apply_report(report(node, f"http://{node}", [pod(index, incarnation, mine)], held), now)
    return incarnation, rank_of


def test_restore_sources_carry_the_owners_checksums_not_the_holders():
    state = ClusterState()
    incarnation, node_rank = running_job(state)
    rank = node_rank["b"]
    view = state.restore_view(KEY, incarnation, rank, now=1.0)
    assert view.step == 5
    assert [(s.holder, s.files) for s in view.sources] == [("b", OWN[rank]), ("a", OWN[rank])]


def test_claims_of_unassigned_nodes_count_for_nothing():
    state = ClusterState()
    running_job(state)
    before = state.safe_step(KEY)
    forged = [HeldStep(*KEY, 10**9, rank, OWN[rank], replica) for rank in (0, 1) for replica in (False, True)]
    for ghost in ("ghost-1", "ghost-2"):
        state.apply_report(report(ghost, f"http://{ghost}", (), forged), 0.5)
    assert {c.step for c in state.copies(KEY)} == {5}
    assert state.safe_step(KEY) == before == 5


def test_a_node_id_is_bound_to_its_url_until_it_falls_silent():
    state = ClusterState(node_timeout_seconds=15.0)
    state.apply_report(report("a", "http://a"), 0.0)
    with pytest.raises(NodeIdTaken, match="http://a"):
        state.apply_report(report("a", "http://evil"), 5.0)
    assert state.nodes["a"].report.url == "http://a"
    state.apply_report(report("a", "http://a-restarted"), 20.0)  # silent past the timeout: a new registration
    assert state.nodes["a"].report.url == "http://a-restarted"
