"""An upgrade and a rollback across releases with real processes: the previous release's coordinator and
node agents (``git archive`` of its commit, ``tests/helpers/releases.py``) beside this tree's, in the
order docs/upgrading.md gives. Each pairing must keep the report and assignment cycle, replication
between the two releases' agents, the safe step and a restore after a preemption working."""

import json
import os
import subprocess
import sys
import urllib.request

from csi_driver import kubelet
from examples.local_cluster import LocalCluster, source_env, unmount_all_below
from replicator.local_tier.frameworks.client_dir import RESTORE_SUFFIX, restore_marker_name
from tests.helpers.agents import rank_of, start_fresh
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address
from tests.helpers.steps import commit_step
from tests.helpers.tools import requires_root

NODES = 2
JOB = "upgrade-slice"


def status(cluster: LocalCluster) -> dict:
    """The job's row of ``GET /v1/status`` as plain JSON (either release's coordinator), or {}."""
    with urllib.request.urlopen(f"{cluster.coordinator.url}/v1/status?job={JOB}", context=cluster.coordinator.ssl_context(), timeout=5) as r:
        jobs = json.load(r)["jobs"]
    return jobs[0] if jobs else {}


def holders(cluster: LocalCluster, step: int) -> dict[int, list[str]]:
    """Rank -> the nodes the coordinator knows to hold ``step`` of it."""
    return {int(rank): steps[str(step)] for rank, steps in status(cluster).get("held", {}).items() if str(step) in steps}


def publish(cluster: LocalCluster, tmp_path, pod: str) -> list:
    """Publishes pod ``pod`` of the job on every node, as the kubelet does for a (re)created JobSet."""
    targets = []
    for index, agent in enumerate(cluster.agents):
        target = tmp_path / "pods" / f"{pod}-{index}" / "mount"
        kubelet.publish(agent.endpoint, str(target), f"{JOB}-0-{index}-{pod}", attributes={"nodes": str(NODES), "size": "16Mi"})
        targets.append(target)
    return targets


def restore_markers(targets) -> list[str]:
    """Each pod's restore marker name (``<job>-s<step>-n<rank>-w0.restore``), then removed as Orbax does."""
    found = []
    for target in targets:
        (name,) = [n for n in os.listdir(target) if n.endswith(RESTORE_SUFFIX)]
        found.append(name)
        os.unlink(target / name)
    return found


def save_safely(cluster: LocalCluster, targets, step: int) -> None:
    """Every pod commits ``step`` (as Orbax does); waits until each rank's step is held by both nodes (its
    own and the other's replica) and is the job's safe step."""
    for target in targets:
        commit_step(target, step, {"state/data": os.urandom(4096), "_CHECKPOINT_METADATA": b"{}"})
    wait_until(lambda: all(sorted(holders(cluster, step).get(rank, ())) == ["node-0", "node-1"] for rank in range(NODES)), 60,
               lambda: f"step {step} held by both nodes for each rank: {status(cluster).get('held')}")  # fmt: skip
    wait_until(lambda: status(cluster).get("safe_step") == step, 30, lambda: f"step {step} safe: {status(cluster)}")


def preempt_and_restore(cluster: LocalCluster, tmp_path, targets, pod: str, step: int) -> list:
    """Deletes the pods and recreates them (a preemption): the new pods get ranks and restore ``step``."""
    for agent, target in zip(cluster.agents, targets):
        kubelet.unpublish(agent.endpoint, str(target))
    targets = publish(cluster, tmp_path, pod)
    start_fresh(targets, "upgrade", nodes=NODES, timeout=60, backup_interval_minutes=60)
    ranks = [rank_of(t) for t in targets]
    assert sorted(ranks) == list(range(NODES))
    assert restore_markers(targets) == [restore_marker_name(JOB, step, rank) for rank in ranks]
    return targets


@requires_root
def test_a_release_upgrade_and_rollback_keep_reports_replication_and_restores_working(tmp_path, previous_release):
    old = previous_release
    env, cwd = source_env(old)
    imported = subprocess.run([sys.executable, "-c", "import replicator.cli; print(replicator.cli.__file__)"], env=env, cwd=cwd,
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert imported == os.path.join(old, "replicator", "cli.py")  # the previous release's processes run its code
    cluster = LocalCluster(str(tmp_path / "cluster"), listen_address, coordinator_source=old)
    try:
        # The previous release everywhere: a job gets ranks, saves, and step 1 becomes safe.
        cluster.coordinator.start()
        for index in range(NODES):
            cluster.add_node(index, source=old)
        targets = publish(cluster, tmp_path, "a")
        start_fresh(targets, "upgrade", nodes=NODES, timeout=60, take_markers=True, backup_interval_minutes=60)
        save_safely(cluster, targets, 1)

        # The coordinator first: the previous release's agents report to this release's coordinator.
        cluster.restart_coordinator()
        wait_until(lambda: holders(cluster, 1) and status(cluster).get("safe_step") == 1, 30, lambda: f"state rebuilt: {status(cluster)}")
        save_safely(cluster, targets, 2)

        # The DaemonSet's rolling update, one node at a time: this release's agent beside the previous
        # release's, on the same ramdisks (the job keeps running).
        cluster.restart_node(0)
        save_safely(cluster, targets, 3)
        targets = preempt_and_restore(cluster, tmp_path, targets, "b", 3)
        save_safely(cluster, targets, 4)

        # A rollback of the coordinator: this release's agent reports to the previous release's coordinator.
        cluster.restart_coordinator(old)
        wait_until(lambda: status(cluster).get("safe_step") == 4, 30, lambda: f"state rebuilt by the previous release: {status(cluster)}")
        save_safely(cluster, targets, 5)
        targets = preempt_and_restore(cluster, tmp_path, targets, "c", 5)

        # Both agents of this release against the previous coordinator, then against this one.
        cluster.restart_node(1)
        save_safely(cluster, targets, 6)
        cluster.restart_coordinator()
        targets = preempt_and_restore(cluster, tmp_path, targets, "d", 6)
        refused = [line for p in (*cluster.agents, cluster.coordinator) for line in open(p.log_path, encoding="utf-8") if "protocol version" in line]
        assert refused == []
    finally:
        cluster.stop()
        unmount_all_below(str(tmp_path))
