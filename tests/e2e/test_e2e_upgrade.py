"""An upgrade and a rollback across releases with real processes: the previous release's coordinator and
node agents (``git archive`` of its commit, ``tests/helpers/releases.py``) beside this tree's, in the
order docs/upgrading.md gives. Each pairing must keep the report and assignment cycle, replication
between the two releases' agents, the safe step and a restore after a preemption working; a real
training job keeps saving through a rolling upgrade and restores after it."""

import os
import subprocess
import sys

from csi_driver import kubelet
from examples.local_cluster import LocalCluster, source_env, unmount_all_below
from replicator.local_tier.frameworks.client_dir import RESTORE_SUFFIX, restore_marker_name
from tests.helpers.agents import job_status, publish_pods, rank_of, save_until_safe, start_fresh
from tests.helpers.jobs import (
    UNTIL_KILLED,
    by_event,
    committed,
    compared_losses,
    kill_past_newest_commit,
    losses,
    rerun,
    run_job,
)
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address
from tests.helpers.releases import restart_coordinator, restart_node
from tests.helpers.tools import requires_root

NODES = ["node-0", "node-1"]
JOB = "upgrade"


def restore_markers(targets) -> list[str]:
    """Each pod's restore marker name (``<job>-s<step>-n<rank>-w0.restore``), then removed as Orbax does."""
    found = []
    for target in targets:
        (name,) = [n for n in os.listdir(target) if n.endswith(RESTORE_SUFFIX)]
        found.append(name)
        os.unlink(target / name)
    return found


def preempt_and_restore(cluster: LocalCluster, tmp_path, targets, pod: str, step: int) -> list:
    """Deletes the pods and recreates them (a preemption): the new pods get ranks and restore ``step``."""
    for agent, target in zip(cluster.agents, targets):
        kubelet.unpublish(agent.endpoint, str(target))
    targets = publish_pods(cluster.agents, tmp_path / "pods", JOB, pod)
    start_fresh(targets, JOB, nodes=len(NODES), timeout=60, backup_interval_minutes=60)
    ranks = [rank_of(t) for t in targets]
    assert sorted(ranks) == list(range(len(NODES)))
    assert restore_markers(targets) == [restore_marker_name(f"{JOB}-slice", step, rank) for rank in ranks]
    return targets


def safe_step(cluster: LocalCluster) -> int | None:
    return job_status(cluster.coordinator, f"{JOB}-slice").get("safe_step")


@requires_root
def test_a_release_upgrade_and_rollback_keep_reports_replication_and_restores_working(tmp_path, previous_release):
    old = previous_release
    env, cwd = source_env(old)
    imported = subprocess.run(
        [sys.executable, "-c", "import replicator.cli; print(replicator.cli.__file__)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert imported.startswith(os.path.join(old, "replicator", ""))  # the previous release's processes run its code
    cluster = LocalCluster(str(tmp_path / "cluster"), listen_address, coordinator_source=old)
    try:
        # The previous release everywhere: a job gets ranks, saves, and step 1 becomes safe.
        cluster.coordinator.start()
        for index in range(len(NODES)):
            cluster.add_node(index, source=old)
        targets = publish_pods(cluster.agents, tmp_path / "pods", JOB, "a")
        start_fresh(targets, JOB, nodes=len(NODES), timeout=60, take_markers=True, backup_interval_minutes=60)
        save_until_safe(cluster.coordinator, targets, JOB, 1, NODES)

        # The coordinator first: the previous release's agents report to this release's coordinator.
        restart_coordinator(cluster)
        wait_until(
            lambda: safe_step(cluster) == 1,
            30,
            lambda: f"state rebuilt: {job_status(cluster.coordinator, f'{JOB}-slice')}",
        )
        save_until_safe(cluster.coordinator, targets, JOB, 2, NODES)

        # The DaemonSet's rolling update, one node at a time: this release's agent beside the previous
        # release's, on the same ramdisks (the job keeps running).
        restart_node(cluster, 0)
        save_until_safe(cluster.coordinator, targets, JOB, 3, NODES)
        targets = preempt_and_restore(cluster, tmp_path, targets, "b", 3)
        save_until_safe(cluster.coordinator, targets, JOB, 4, NODES)

        # A rollback of the coordinator: this release's agent reports to the previous release's coordinator.
        restart_coordinator(cluster, old)
        wait_until(
            lambda: safe_step(cluster) == 4,
            30,
            lambda: f"rebuilt by the previous release: {job_status(cluster.coordinator, f'{JOB}-slice')}",
        )
        save_until_safe(cluster.coordinator, targets, JOB, 5, NODES)
        targets = preempt_and_restore(cluster, tmp_path, targets, "c", 5)

        # Both agents of this release against the previous coordinator; then an agent rolled back on the
        # same ramdisks; then this release everywhere.
        restart_node(cluster, 1)
        save_until_safe(cluster.coordinator, targets, JOB, 6, NODES)
        restart_node(cluster, 0, old)
        save_until_safe(cluster.coordinator, targets, JOB, 7, NODES)
        restart_coordinator(cluster)
        restart_node(cluster, 0)
        targets = preempt_and_restore(cluster, tmp_path, targets, "d", 7)
        save_until_safe(cluster.coordinator, targets, JOB, 8, NODES)
        refused = [
            line
            for p in (*cluster.agents, cluster.coordinator)
            for line in open(p.log_path, encoding="utf-8")
            if "protocol version" in line
        ]
        assert refused == []
    finally:
        cluster.stop()
        unmount_all_below(str(tmp_path))


@requires_root
def test_a_training_job_keeps_saving_through_a_rolling_upgrade_and_resumes_exactly_after_it(tmp_path, previous_release):
    cluster = LocalCluster(str(tmp_path / "cluster"), listen_address, coordinator_source=previous_release)
    try:
        cluster.coordinator.start()
        for index in range(len(NODES)):
            cluster.add_node(index, source=previous_release)
        job = run_job(
            "roll",
            cluster.agents,
            tmp_path / "roll",
            [*UNTIL_KILLED, "--data-parallelism", "1", "--dump-dir", str(tmp_path / "dump-1")],
            slices=1,
        )

        def safe_past(step: int) -> bool:
            return (job_status(cluster.coordinator, job.job).get("safe_step") or 0) > step

        job.wait(lambda: safe_past(0), 240, "a step safe under the previous release")
        # The upgrade while the job trains: the coordinator, then each node's agent on the same ramdisks.
        restarts = (
            lambda: restart_coordinator(cluster),
            lambda: restart_node(cluster, 0),
            lambda: restart_node(cluster, 1),
        )
        for restart in restarts:
            newest = max(max(steps, default=0) for steps in committed(job))
            restart()
            job.wait(lambda: safe_past(newest), 120, f"a step after {newest} safe after the restart")
        before = kill_past_newest_commit(job)
        step = max(set.intersection(*committed(job)))
        rerun(job, tmp_path / "dump-2", steps=step + 6)
        assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [step] * len(NODES)
        after = losses(job.pods)
        assert min(after) == step + 1
        compared_losses(before, after)  # the restored run goes on exactly as the killed one did
    finally:
        cluster.stop()
        unmount_all_below(str(tmp_path))
