"""Elastic restore planning (``planner.plan_restore`` with ``shapes``, ``planner.old_nodes_needed``) as pure functions."""

import itertools

import pytest

from replicator.coordinator.planner import StepCopy, Tier, old_nodes_needed, plan_restore

pytestmark = pytest.mark.unit


def chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s split of ``rows`` over ``ranks`` (FSDP's dim-0 sharding): each rank's [start, end)."""
    size = -(-rows // ranks)
    return [(min(rows, i * size), min(rows, (i + 1) * size)) for i in range(ranks)]


def test_the_old_nodes_staged_hold_every_row_a_new_node_needs_within_the_documented_size():
    checked = 0
    for old, old_local, new, new_local in itertools.product(range(1, 6), range(1, 4), range(1, 6), range(1, 4)):
        if (old, old_local) == (new, new_local):
            continue
        smallest = max(new * new_local * old, old * old_local * (old - 1))
        for rows in range(max(1, smallest), smallest + 24):
            stored = chunks(rows, old * old_local)
            for rank, (start, end) in enumerate(chunks(rows, new * new_local)):
                holders = {
                    next(r for r, (a, b) in enumerate(stored) if a <= row < b) // old_local for row in range(start, end)
                }
                assert holders <= set(old_nodes_needed(rank // new_local, new, old)), (
                    old,
                    old_local,
                    new,
                    new_local,
                    rows,
                )
                checked += 1
    assert checked > 10_000


def test_a_job_of_2_old_nodes_stages_both_on_every_new_node_and_a_larger_one_only_the_overlap_and_its_neighbours():
    assert [list(old_nodes_needed(r, 1, 2)) for r in range(1)] == [[0, 1]]
    assert [list(old_nodes_needed(r, 3, 2)) for r in range(3)] == [[0, 1]] * 3
    assert [list(old_nodes_needed(r, 16, 8)) for r in (0, 7, 15)] == [[0, 1], [2, 3, 4], [6, 7]]
    assert [list(old_nodes_needed(r, 7, 8)) for r in (0, 3, 6)] == [[0, 1, 2], [2, 3, 4, 5], [5, 6, 7]]


ONE_BLOCK = {f"n{i}": "b0" for i in range(4)}


def copies_of(step: int, ranks: int, replica_on_next: bool = True) -> list[StepCopy]:
    """Rank r's own copy on node n<r> and, optionally, its replica on the next node."""
    found = [StepCopy(step, r, f"n{r}") for r in range(ranks)]
    if replica_on_next:
        found += [StepCopy(step, r, f"n{(r + 1) % ranks}") for r in range(ranks)]
    return found


def test_a_step_of_2_nodes_restores_on_1_node_from_its_own_copy_and_the_replica_it_holds():
    plan = plan_restore(1, {0: "n0"}, copies_of(10, 2), ONE_BLOCK, shapes={10: 2})
    assert plan.step == 10 and plan.saved_nodes == 2
    assert [(s.data_rank, s.tier, s.holder) for s in plan.sources[0]] == [
        (0, Tier.LOCAL, "n0"),
        (0, Tier.PEER_CLOSE, "n1"),
        (1, Tier.LOCAL, "n0"),
        (1, Tier.PEER_CLOSE, "n1"),
    ]


def test_a_scale_up_stages_each_old_copy_from_the_fastest_tier_and_the_backup_last():
    backups = [StepCopy.backed_up(10, r) for r in range(2)]
    plan = plan_restore(3, {0: "n0", 1: "n1", 2: "n2"}, copies_of(10, 2, False) + backups, ONE_BLOCK, shapes={10: 2})
    assert plan.saved_nodes == 2
    assert [(s.data_rank, s.tier) for s in plan.sources[2]] == [
        (0, Tier.PEER_CLOSE),
        (0, Tier.BACKUP),
        (1, Tier.PEER_CLOSE),
        (1, Tier.BACKUP),
    ]
    assert [(s.data_rank, s.tier) for s in plan.sources[1]][2] == (1, Tier.LOCAL)


def test_a_step_an_old_node_lacks_is_never_planned_an_older_whole_one_is():
    held = copies_of(10, 2) + [c for c in copies_of(20, 2) if c.rank == 0]
    plan = plan_restore(1, {0: "n0"}, held, shapes={10: 2, 20: 2})
    assert plan.step == 10 and plan.saved_nodes == 2
    assert plan_restore(1, {0: "n0"}, held[4:], shapes={20: 2}).step is None


def test_a_step_of_the_jobs_own_node_count_is_planned_as_before():
    plan = plan_restore(2, {0: "n0", 1: "n1"}, copies_of(30, 2) + copies_of(10, 3), shapes={10: 3})
    assert plan.step == 30 and plan.saved_nodes is None
    assert {s.data_rank for s in plan.sources[1]} == {1}
