"""The chaos suite's fixed-seed subset, part of ``make e2e-operations`` (CI runs it after ``make test``): a real Orbax job (4 processes,
2 slices, data parallelism 2) on real agents, coordinator and ``file://`` backup store survives
six seeded faults, each restoring the newest possible step with values identical to an
uninterrupted run; and, with data parallelism 1, a node cut from its peers. ``make chaos`` runs the
long random sequence over every fault and every variant."""

import random

from tests.drivers import chaos

SEED = 10
# Faults that cost ~20 s each (a rollback two restarts); seed 10 draws six of them, a rollback among
# them. ``make chaos`` draws from every fault: the freezes, the store outage and the flips in another
# node's copy or a backup pass too but take 40-80 s (a lost holder is waited for during the 60 s grace
# period).
QUICK_FAULTS = [
    "preemption",
    "node_loss",
    "flip_local",
    "kill_mid_gc",
    "kill_mid_stage",
    "coordinator_kill_mid_restore",
    "kill_mid_upload",
    "rollback",
]


def test_fixed_seed_faults_restore_the_newest_possible_step_with_identical_values(tmp_path):
    # Not patient: each failure's RPO sample is taken at once (stricter), so the subset takes no longer.
    rows = chaos.run(SEED, 6, "dp2", QUICK_FAULTS, str(tmp_path), patient=False)
    table = chaos.render(rows) + "\n" + chaos.summary(rows)
    print(table)
    assert len(rows) >= 6, table
    assert all(row.right for row in rows), table
    assert all(row.restored is not None for row in rows), table  # never a fresh start: a complete step always existed


PARTITION_SEED = 101  # draws a cut that heals before the failure; the agent's pushes to its peers fail meanwhile


def test_a_node_cut_from_its_peers_while_the_job_saves_costs_no_step(tmp_path):
    """Data parallelism 1, ``--replicas 2``: one node's agent is cut from the other agents (iptables on its own
    loopback address) for 6-30 s while the job saves, then every training process fails."""
    rows = chaos.run(PARTITION_SEED, 1, "dp1", ["partition_from_peers"], str(tmp_path), patient=False)
    table = chaos.render(rows) + "\n" + chaos.summary(rows)
    print(table)
    assert len(rows) == 1 and "cut from its peers" in rows[0].fault, table
    assert all(row.right for row in rows), table
    assert rows[0].restored is not None, table


def test_a_sequence_that_restored_no_step_compared_no_value_and_is_wrong(tmp_path):
    suite = chaos.Chaos(str(tmp_path), "dp2", random.Random(SEED))  # nothing started
    suite.rows = [chaos.Row("preemption", restored=None, possible=None)]  # a fresh start, "right" on its own
    suite.check_values()
    assert not suite.rows[-1].right and "no value compared" in suite.rows[-1].problems[0]


def test_under_xor_parity_a_lost_node_and_a_flipped_parity_shard_restore_the_newest_possible_step(tmp_path):
    """Data parallelism 1 with ``--redundancy xor:4`` (issue 41), no full copies: a node lost is rebuilt from its
    group; a byte flipped in a shard its rebuild needs is caught and the newest backup serves instead."""
    rows = chaos.run(SEED, 2, "xor", ["node_loss", "flip_parity"], str(tmp_path), patient=False)
    table = chaos.render(rows) + "\n" + chaos.summary(rows)
    print(table)
    assert len(rows) == 2, table
    assert all(row.right for row in rows), table
    assert all(row.restored is not None for row in rows), table
