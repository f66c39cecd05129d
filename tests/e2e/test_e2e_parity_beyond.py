"""Parity redundancy when more nodes of a group are lost than it tolerates (issue 41): the backup tier serves
every rank, the job resumes exactly. In ``make e2e-operations`` (CI runs it after ``make test``)."""

from tests.e2e.test_e2e_parity import SAVES
from tests.helpers.jobs import (
    assert_resumed_exactly,
    by_event,
    kill_past_newest_commit,
    replace_node,
    rerun,
    run_job,
    status_of,
)


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
