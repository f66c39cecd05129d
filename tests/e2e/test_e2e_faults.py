"""Transient faults with a real Orbax job: a frozen agent is not a lost node, and costs no checkpoint."""

import threading

from tests.helpers.jobs import UNTIL_KILLED as LONG_RUN
from tests.helpers.jobs import (
    assert_resumed_exactly,
    kill_past_newest_commit,
    lose_node_and_resume,
    losses,
    run_job,
    status_of,
    wait_safe_is_newest,
)


def freeze(agent, seconds: float) -> threading.Thread:
    """SIGSTOPs the agent now and SIGCONTs it after ``seconds`` (a frozen VM, a long GC pause)."""
    agent.pause()
    thaw = threading.Timer(seconds, agent.resume)
    thaw.start()
    return thaw


def test_an_agent_frozen_past_the_node_timeout_does_not_stop_backups(start_cluster, tmp_path):
    cluster = start_cluster(backup=f"file://{tmp_path / 'objects'}")  # node timeout 4 s
    job = run_job("frz", list(cluster.agents), tmp_path / "frz", [*LONG_RUN, "--backup-interval-steps", "3"])
    job.wait(lambda: len(status_of(cluster, job)["backups"]) >= 1, 180, "a first backup")
    incarnation = status_of(cluster, job)["incarnation"]
    freeze(cluster.agents[1], 12.0).join()
    after_thaw = max(losses(job.pods))
    job.wait(
        lambda: max(status_of(cluster, job)["backups"], default=-1) > after_thaw,
        120,
        "a backup of a step after the freeze",
    )
    assert status_of(cluster, job)["incarnation"] == incarnation  # the blip did not end the incarnation
    assert all(agent.process.poll() is None for agent in cluster.agents)


def test_node_loss_while_the_only_other_holder_is_frozen_restores_the_newest_step(start_cluster, tmp_path):
    cluster = start_cluster()
    job = run_job("dpf", list(cluster.agents), tmp_path / "dpf", [*LONG_RUN, "--dump-dir", str(tmp_path / "dump-1")])
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 9,
        180,
        "identity at step 9",
    )
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 30, "identity of the last step")
    safe = status_of(cluster, job)["safe_step"]
    # Rank 1's only other copy is rank 3's identical data on node-3: freeze it for 20 s (5x the node
    # timeout) while node-1 is lost and the pods are recreated (its pod's unpublish waits for it, as
    # kubelet's would).
    thaw = freeze(cluster.agents[3], 20.0)
    lose_node_and_resume(cluster, job, 1, tmp_path, steps=safe + 6)
    thaw.join()
    assert_resumed_exactly(job, safe, before, tmp_path)
    assert status_of(cluster, job)["restore"]["sources"]["1"] == "peer_distant:node-3"
