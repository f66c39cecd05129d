"""Parity redundancy when a lost rank cannot be rebuilt: more nodes of a group lost than it tolerates (issue 41), or
a parity shard that fails its checksum (issue 49). The backup tier serves every rank, the job resumes exactly. In
``make e2e-operations`` (CI runs it after ``make test``)."""

import time

from replicator.coordinator.api.config import CoordinatorConfig
from replicator.local_tier.parity_shards import ParityShards
from tests.e2e.test_e2e_parity import SAVES
from tests.helpers.jobs import (
    assert_resumed_exactly,
    by_event,
    kill_past_newest_commit,
    replace_node,
    rerun,
    run_job,
    status_of,
    wait_safe_is_newest,
)
from tests.helpers.steps import flip_byte


def test_more_nodes_lost_than_a_group_tolerates_restore_from_the_backup_tier(start_cluster, tmp_path):
    """rs:4:2 and three of the four nodes lost: no decode is possible; every rank restores the newest backup."""
    cluster = start_cluster(agent_args=["--redundancy", "rs:4:2"], backup=f"file://{tmp_path / 'objects'}")
    job = run_job("rs3", list(cluster.agents), tmp_path / "rs3", [*SAVES, "--dump-dir", str(tmp_path / "dump-1")])
    job.wait(lambda: len(status_of(cluster, job)["backups"]) >= 1, 180, "a first backup")
    before = kill_past_newest_commit(job)
    backed = max(status_of(cluster, job)["backups"])
    job.kill_training()
    for index in (1, 2, 3):
        job.agents[:] = replace_node(cluster, job, index)
    rerun(job, tmp_path / "dump-2", agents=list(job.agents), steps=backed + 6)
    restored = [by_event(p, "restored")[0]["step"] for p in job.pods]
    assert restored == [backed] * 4, restored  # no partial step: every rank restored the backed-up one
    sources = status_of(cluster, job)["restore"]["sources"]
    assert [sources[str(r)].split(":")[0] for r in (1, 2, 3)] == ["backup"] * 3, sources
    assert_resumed_exactly(job, backed, before, tmp_path)


def test_a_decode_that_fails_its_checksums_restores_the_backup_without_waiting_out_the_lost_nodes_grace(
    start_cluster, tmp_path
):
    """xor:4, a byte flipped in the parity shard of stripe 2 (on rank 2's node), then rank 1's node lost: the decode
    fails the owner's checksums, and the lost node held the only other copy of rank 1's step. The restore moves to
    the backup once that node is silent (the cluster's 4 s node timeout), not after its 60 s grace period."""
    cluster = start_cluster(agent_args=["--redundancy", "xor:4"], backup=f"file://{tmp_path / 'objects'}")
    train = [*SAVES, "--backup-interval-steps", "1000", "--dump-dir", str(tmp_path / "dump-1")]  # one backup
    job = run_job("flip", list(cluster.agents), tmp_path / "flip", train)
    job.wait(
        lambda: (s := status_of(cluster, job))["backups"] and (s["safe_step"] or 0) > max(s["backups"]),
        180,
        "a step safe under parity newer than the first backup",
    )
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 60, "parity caught up with the newest step")
    status = status_of(cluster, job)
    safe, backed = status["safe_step"], max(status["backups"])
    assert status["held"]["1"][str(safe)] == ["node-1", "parity"], status["held"]  # no other full copy
    job.kill_training()
    flip_byte(ParityShards(job.agents[2].ramdisk(job.job)).path(safe, 0, 2))
    lost_at = time.time()
    job.agents[:] = replace_node(cluster, job, 1)
    rerun(job, tmp_path / "dump-2", agents=list(job.agents), steps=backed + 6)
    assert_resumed_exactly(job, backed, before, tmp_path)
    assert [list(c) for c in status_of(cluster, job)["restore"]["unusable_copies"]] == [[safe, 1, "parity"]]
    resumed = min(e["time"] for p in job.pods for e in by_event(p, "step")) - lost_at
    assert resumed < CoordinatorConfig("").holder_grace_seconds, f"resumed {resumed:.0f} s after the loss"
