"""Erasure-coded RAM copies end to end (issue 41): real agents with ``--redundancy xor:N`` or ``rs:N:K``, a real
coordinator and a real Orbax job with data parallelism 1. Lost nodes' ranks are rebuilt from their group's
survivors and parity shards. Too many lost for a group: ``test_e2e_parity_beyond.py`` (in ``make e2e-operations``)."""

from tests.helpers.agents import scrape
from tests.helpers.jobs import (
    UNTIL_KILLED,
    assert_resumed_exactly,
    kill_past_newest_commit,
    replace_node,
    rerun,
    run_job,
    status_of,
    wait_safe_is_newest,
)

SAVES = ["--data-parallelism", "1", *UNTIL_KILLED, "--save-interval-steps", "1", "--step-sleep", "0.3"]


def _started(start_cluster, tmp_path, redundancy, name, backup=None, peer_grants=False):
    cluster = start_cluster(agent_args=["--redundancy", redundancy], backup=backup, peer_grants=peer_grants)
    job = run_job(name, list(cluster.agents), tmp_path / name, [*SAVES, "--dump-dir", str(tmp_path / "dump-1")])
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 3,
        180,
        "a step safe under parity (every group's shards built)",
    )
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 60, "parity caught up with the newest step")
    return cluster, job, before


def _lose(cluster, job, tmp_path, lost, steps):
    job.kill_training()
    for index in lost:
        job.agents[:] = replace_node(cluster, job, index)
    rerun(job, tmp_path / "dump-2", agents=list(job.agents), steps=steps)


def test_xor_group_rebuilds_a_lost_node_bit_identically_without_full_copies(start_cluster, tmp_path):
    """With peer grants on (issue 40): every read of an encode and of the rebuild carries the coordinator's grant."""
    cluster, job, before = _started(start_cluster, tmp_path, "xor:4", "xor", peer_grants=True)
    status = status_of(cluster, job)
    safe = status["safe_step"]
    # No full replica anywhere: each rank's step is on its own node and decodable from its group.
    assert all(steps[str(safe)] == [f"node-{r}", "parity"] for r, steps in status["held"].items()), status["held"]
    _lose(cluster, job, tmp_path, [1], safe + 6)
    assert_resumed_exactly(job, safe, before, tmp_path)
    assert status_of(cluster, job)["restore"]["sources"]["1"] == "decode:parity"
    for agent in job.agents:  # every encode's and the rebuild's reads were granted
        assert "mtc_peer_grant_refusals_total{" not in scrape(agent.url), agent.node_id


def test_reed_solomon_group_rebuilds_two_lost_nodes_of_one_group_bit_identically(start_cluster, tmp_path):
    cluster, job, before = _started(start_cluster, tmp_path, "rs:4:2", "rs")
    safe = status_of(cluster, job)["safe_step"]
    _lose(cluster, job, tmp_path, [1, 2], safe + 6)
    assert_resumed_exactly(job, safe, before, tmp_path)
    sources = status_of(cluster, job)["restore"]["sources"]
    assert sources["1"] == sources["2"] == "decode:parity", sources
    assert sources["0"] == "local:node-0" and sources["3"] == "local:node-3", sources
