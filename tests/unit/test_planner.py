"""Rank assignment and restore planning as pure functions, including at 10,000 nodes."""

import random

import pytest

from replicator.coordinator.planner import (
    PlannedSource,
    PodSlot,
    StepCopy,
    Tier,
    assign_ranks,
    plan_restore,
    replica_targets,
    select_pods,
)


def pods_on(nodes, uid_prefix="p", slices=1, t=0.0):
    per_slice = len(nodes) // slices
    return [PodSlot(f"{uid_prefix}{i}", node, i // per_slice, i % per_slice, t) for i, node in enumerate(nodes)]


def test_ranks_follow_data_after_restart_even_when_pods_land_on_other_nodes():
    # The previous incarnation: rank r on node n<r>, each holding step 20 of its own rank.
    held = {f"n{r}": {r: 20} for r in range(4)}
    # The new pods land in a shuffled order: pod index no longer matches node.
    new_pods = pods_on(["n2", "n0", "n3", "n1"], uid_prefix="new", slices=2)
    ranks = assign_ranks(new_pods, 4, 2, held)
    assert {p.node_id: ranks[p.pod_uid] for p in new_pods} == {"n0": 0, "n1": 1, "n2": 2, "n3": 3}


def test_newest_data_wins_and_no_rank_is_duplicated():
    # Both nodes hold rank 0 (n1 an older copy); n1 also has the newest rank-1 data.
    held = {"a": {0: 30}, "b": {0: 10, 1: 30}}
    ranks = assign_ranks(pods_on(["a", "b"]), 2, 1, held)
    assert ranks == {"p0": 0, "p1": 1}
    held = {"a": {0: 30}, "b": {0: 40}}
    ranks = assign_ranks(pods_on(["a", "b"]), 2, 1, held)
    assert ranks == {"p1": 0, "p0": 1}


def test_fresh_job_uses_initial_ranks_from_slice_and_worker():
    pods = [
        PodSlot("x", "n9", 1, 0, 0),
        PodSlot("y", "n8", 0, 1, 0),
        PodSlot("z", "n7", 1, 1, 0),
        PodSlot("w", "n6", 0, 0, 0),
    ]
    assert assign_ranks(pods, 4, 2, {}) == {"w": 0, "y": 1, "x": 2, "z": 3}


def test_partial_incarnation_waits_and_old_pods_drop_out():
    old = pods_on(["a", "b"], uid_prefix="old", t=1.0)
    assert select_pods(old[:1], 2) is None
    new = pods_on(["c", "d"], uid_prefix="new", t=2.0)
    assert {p.pod_uid for p in select_pods(old + new, 2)} == {"new0", "new1"}
    with pytest.raises(ValueError):
        assign_ranks(old[:1], 2, 1, {})


def test_assignment_at_ten_thousand_nodes_is_a_permutation_with_full_locality():
    n = 10_000
    nodes = [f"node-{i}" for i in range(n)]
    held = {node: {r: 100} for r, node in enumerate(nodes)}
    shuffled = nodes[:]
    random.Random(7).shuffle(shuffled)
    pods = pods_on(shuffled, slices=4)
    ranks = assign_ranks(pods, n, 4, held)
    assert sorted(ranks.values()) == list(range(n))
    assert all(ranks[p.pod_uid] == int(p.node_id.split("-")[1]) for p in pods)


def test_restore_picks_newest_step_complete_for_every_rank():
    node_of = {0: "a", 1: "b"}
    copies = [
        StepCopy(10, 0, "a"),
        StepCopy(10, 1, "b"),
        StepCopy(20, 0, "a"),
        StepCopy(20, 1, "b"),
        StepCopy(30, 0, "a"),
    ]
    plan = plan_restore(2, node_of, copies)
    assert plan.step == 20  # step 30 exists for rank 0 only
    assert plan.sources[1][0].tier == Tier.LOCAL and plan.sources[1][0].holder == "b"


def test_restore_skips_steps_a_rank_cannot_reach_and_falls_back_to_fresh_start():
    node_of = {0: "a", 1: "fresh"}
    copies = [StepCopy(20, 0, "a"), StepCopy(20, 1, "gone"), StepCopy(10, 0, "a"), StepCopy(10, 1, "fresh")]
    assert plan_restore(2, node_of, copies, usable_tiers=frozenset({Tier.LOCAL})).step == 10
    assert plan_restore(2, node_of, [StepCopy(20, 0, "a")]).step is None


def test_restore_sources_are_ordered_local_close_distant_backup():
    copies = [
        StepCopy.backed_up(5, 0),
        StepCopy(5, 0, "far"),
        StepCopy(5, 0, "near"),
        StepCopy(5, 0, "me"),
    ]
    plan = plan_restore(1, {0: "me"}, copies, block_of={"me": "b1", "near": "b1", "far": "b2"})
    assert [(s.tier, s.holder) for s in plan.sources[0]] == [
        (Tier.LOCAL, "me"),
        (Tier.PEER_CLOSE, "near"),
        (Tier.PEER_DISTANT, "far"),
        (Tier.BACKUP, "backup"),
    ]


def test_data_parallel_peer_copy_serves_a_rank_only_when_identical():
    node_of = {0: "a", 1: "fresh", 2: "c", 3: "d"}
    copies = [StepCopy(9, r, n) for r, n in [(0, "a"), (2, "c"), (3, "d")]]  # rank 1's node was lost
    assert plan_restore(4, node_of, copies).step is None
    identical = {9: frozenset({(1, 3), (3, 1), (0, 2), (2, 0)})}
    plan = plan_restore(4, node_of, copies, block_of={"fresh": "b0", "d": "b1"}, identical=identical)
    assert plan.step == 9
    assert [(s.tier, s.holder, s.data_rank) for s in plan.sources[1]] == [(Tier.PEER_DISTANT, "d", 3)]
    assert plan.sources[0][0] == PlannedSource(Tier.LOCAL, "a", 0)


def test_a_ranks_own_data_comes_before_an_identical_peers_in_the_same_tier():
    # Rank 1's node was lost; "r" holds its replica, "d" rank 3's own copy (first by name). A peer's files may be
    # other bytes (Orbax), and a step restored in other bytes drops its pending backup: the replica goes first.
    node_of = {0: "a", 1: "fresh", 2: "c", 3: "d"}
    copies = [StepCopy(9, r, n) for r, n in [(0, "a"), (2, "c"), (3, "d"), (1, "r")]]
    identical = {9: frozenset({(1, 3), (3, 1), (0, 2), (2, 0)})}
    plan = plan_restore(4, node_of, copies, block_of={"fresh": "b0", "c": "b1"}, identical=identical)
    assert [(s.tier, s.holder, s.data_rank) for s in plan.sources[1]] == [
        (Tier.PEER_DISTANT, "r", 1),
        (Tier.PEER_DISTANT, "d", 3),
    ]
    # A faster tier still wins: a peer's copy in the rank's block before its replica elsewhere.
    plan = plan_restore(4, node_of, copies, block_of={"fresh": "b0", "d": "b0"}, identical=identical)
    assert [(s.tier, s.holder) for s in plan.sources[1]] == [(Tier.PEER_CLOSE, "d"), (Tier.PEER_DISTANT, "r")]


class CountingPairs(dict):
    """step -> identical pairs, counting how often the planner looks a step's pairs up."""

    lookups = 0

    def get(self, step, default=None):
        self.lookups += 1
        return super().get(step, default)


def test_data_parallel_plan_reads_each_steps_pairs_once_not_once_per_rank():
    nodes, slices = 2_000, 8  # 14,000 identical pairs per step: once per rank would be 28 million
    per_slice = nodes // slices
    node_of = {r: f"n{r}" for r in range(nodes)}
    pairs = frozenset((r, p) for r in range(nodes) for p in range(r % per_slice, nodes, per_slice) if p != r)
    identical = CountingPairs({20: pairs, 10: pairs})
    lost = set(range(0, nodes, 7))  # these ranks' nodes were lost: their peers' identical data serves them
    copies = [StepCopy(step, r, f"n{r}") for step in (10, 20) for r in range(nodes) if r not in lost or step == 10]
    plan = plan_restore(nodes, node_of, copies, identical=identical)
    assert plan.step == 20 and identical.lookups == 1
    assert {s.data_rank for s in plan.sources[7]} == set(range(7 % per_slice, nodes, per_slice)) - lost
    assert plan.sources[8][0] == PlannedSource(Tier.LOCAL, "n8", 8)
    assert {s.data_rank for s in plan.sources[8]} == set(range(8, nodes, per_slice)) - lost


def test_replica_targets_are_close_then_distant_spread_and_never_self():
    node_of = {r: f"n{r}" for r in range(8)}
    blocks = {f"n{r}": f"b{r // 4}" for r in range(8)}
    targets = replica_targets(node_of, blocks, replicas=2)
    assert targets[0] == ["n1", "n4"] and targets[3] == ["n0", "n7"]
    assert all(node_of[r] not in t for r, t in targets.items())
    assert all(blocks[t[0]] == blocks[node_of[r]] and blocks[t[1]] != blocks[node_of[r]] for r, t in targets.items())
    hosted = [node for t in targets.values() for node in t]
    assert max(hosted.count(n) for n in set(hosted)) == 2
    assert replica_targets(node_of, blocks, replicas=1) == {r: t[:1] for r, t in targets.items()}


def test_replica_targets_with_single_node_blocks_go_to_another_block():
    targets = replica_targets({0: "a", 1: "b"}, {"a": "x", "b": "y"}, replicas=1)
    assert targets == {0: ["b"], 1: ["a"]}
