"""Erasure-coded RAM copies end to end (issue 41): real agents with ``--redundancy xor:N`` or ``rs:N:K``, a real
coordinator and a real Orbax job with data parallelism 1. Lost nodes' ranks are rebuilt from their group's
survivors and parity shards. Too many lost for a group: ``test_e2e_parity_beyond.py`` (in ``make e2e-operations``)."""

from tests.helpers.agents import scrape
from tests.helpers.jobs import (
    UNTIL_KILLED,
    assert_resumed_exactly,
    coordinator_recorded,
    kill_past_newest_commit,
    replace_node,
    rerun,
    run_job,
    status_of,
    wait_safe_is_newest,
)

SAVES = ["--data-parallelism", "1", *UNTIL_KILLED, "--save-interval-steps", "1", "--step-sleep", "0.3"]


def _started(start_cluster, tmp_path, redundancy, name, backup=None, peer_grants=False, env=None, train=()):
    cluster = start_cluster(agent_args=["--redundancy", redundancy], backup=backup, env=env, peer_grants=peer_grants)
    job = run_job(name, list(cluster.agents), tmp_path / name, [*SAVES, *train, "--dump-dir", str(tmp_path / "dump-1")])
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


def test_a_coordinator_restarted_after_a_node_loss_still_rebuilds_the_lost_rank_by_decode(
    fake_gcs, start_cluster, tmp_path
):
    """Issue 49: node 1 is lost, then the coordinator is SIGKILLed and restarted before the job comes back. Node 1's
    checksums and the encode orders its group's shards were built for never come from a report again: the
    restarted coordinator reads them from its state dir and plans the lost rank as a decode, as before, not from
    the older step in the backup tier. (``fake_gcs`` is set up first, so the cluster stops before it.)"""
    store = {"backup": "gs://ckpt/mtc", "env": {"STORAGE_EMULATOR_HOST": fake_gcs.url}}
    # Only step 1 is backed up, so a restore from the backup tier would be older. (At the default interval of 6
    # steps, a fast store had the safe step backed up too and CI failed on this precondition.)
    once = ["--backup-interval-steps", "1000"]
    cluster, job, before = _started(start_cluster, tmp_path, "xor:4", "restart", **store, train=once)
    safe = status_of(cluster, job)["safe_step"]
    assert max(status_of(cluster, job)["backups"] or [0]) < safe
    # Harness sync: the state dir holds the safe step's recipe (it is written within a tick of the decision).
    coordinator_recorded(cluster.coordinator, lambda jobs: any(o["slot"]["step"] == safe for o in jobs[0]["orders"]))
    job.kill_training()
    job.agents[:] = replace_node(cluster, job, 1)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    rerun(job, tmp_path / "dump-2", agents=list(job.agents), steps=safe + 6)
    assert_resumed_exactly(job, safe, before, tmp_path)
    sources = status_of(cluster, job)["restore"]["sources"]
    assert sources["1"] == "decode:parity", sources
