"""The peer tier end to end: a node and its ramdisk are lost, a fresh node joins, and the job
resumes at the newest step from data held by its peers, through real Orbax processes."""

import contextlib
import http.client
import json
import os
import re
import ssl
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from csi_driver import kubelet
from examples.local_cluster import self_signed_certificate
from replicator.pacing import timing
from tests.helpers import network
from tests.helpers.agents import scrape
from tests.helpers.jobs import (
    UNTIL_KILLED,
    assert_resumed_exactly,
    by_event,
    kill_past_newest_commit,
    lose_node_and_resume,
    losses,
    replace_node,
    rerun,
    run_job,
    status_of,
    wait_safe_is_newest,
)
from tests.helpers.steps import flip_byte

LONG_RUN = UNTIL_KILLED
# Data parallelism 1 saving about every 0.5 s, while every connection to a node agent's peer port is delayed
# PUSH_DELAY_MS each way (tests/helpers/network.py) so that one push takes longer than a save interval, and a node
# starts at most one push per peer every 2 s (--min-push-interval-seconds): replication is slower than saving. A
# replication round takes at most two push lanes' turns plus the coordinator's latency
# (replicator/coordinator/copies/replicas.py), so the safe step must advance at least every ADVANCE_BOUND_SECONDS, and
# trail the newest complete step by at most LAG_BOUND_STEPS.
FAST_SAVES = ["--data-parallelism", "1", *LONG_RUN, "--save-interval-steps", "1", "--step-sleep", "0.3"]
PUSH_DELAY_MS = 100
ADVANCE_BOUND_SECONDS = 4 * timing.MIN_PUSH_INTERVAL_SECONDS
LAG_BOUND_STEPS = 30
SAMPLE_SECONDS = 20.0
_PUSHED = re.compile(r"replicated step \d+ of rank \d+ to \S+ in ([0-9.]+) s")


@contextlib.contextmanager
def slowed_pushes(cluster) -> Iterator[None]:
    """Delays the agents' peer ports (pushes and fetches) by PUSH_DELAY_MS each way while the context lasts, and
    checks that the pushes made meanwhile took longer than the job's save interval (about 0.5 s)."""
    logs = {agent.log_path: os.path.getsize(agent.log_path) for agent in cluster.agents}
    with network.delayed([agent.listen for agent in cluster.agents], PUSH_DELAY_MS):
        yield
    pushes = []
    for path, offset in logs.items():
        with (
            contextlib.suppress(FileNotFoundError),
            open(path, encoding="utf-8", errors="replace") as log,
        ):  # a lost node's is gone
            log.seek(offset)
            pushes += [float(m.group(1)) for m in _PUSHED.finditer(log.read())]
    print(f"pushes while slowed: {len(pushes)}, median {statistics.median(pushes):.2f} s, shortest {min(pushes):.2f} s")
    assert statistics.median(pushes) > 0.5, pushes  # the premise: a push takes longer than a save interval


def safe_step_advances(cluster, job) -> tuple[float, int]:
    """Samples the job's status for SAMPLE_SECONDS; returns the longest time the safe step stood still (from the
    first sample to its first advance, between advances, and from the last advance to the end) and the largest
    lag of the safe step behind the newest complete step, in steps."""
    samples = []
    deadline = time.monotonic() + SAMPLE_SECONDS
    while time.monotonic() < deadline:
        status = status_of(cluster, job)
        samples.append((time.monotonic(), status["newest_complete_step"], status["safe_step"]))
        time.sleep(0.2)
    moments = (
        [samples[0][0]]
        + [t for (t, _, safe), (_, _, before) in zip(samples[1:], samples) if safe != before]
        + [samples[-1][0]]
    )
    assert samples[-1][1] - samples[0][1] >= SAMPLE_SECONDS, (
        f"harness: the job saved too slowly to outpace its pushes ({samples[0][1]} -> {samples[-1][1]})"
    )
    still, lag = (
        max(b - a for a, b in zip(moments, moments[1:])),
        max(newest - (safe or 0) for _, newest, safe in samples),
    )
    print(
        f"safe step: stood still at most {still:.1f} s, at most {lag} steps behind the newest complete step "
        f"({samples[0][1]} -> {samples[-1][1]} in {SAMPLE_SECONDS:.0f} s)"
    )
    return still, lag


def test_data_parallel_job_restores_lost_node_from_identical_peer_without_copies(start_cluster, tmp_path):
    cluster = start_cluster()
    job = run_job("dp", list(cluster.agents), tmp_path / "dp", [*LONG_RUN, "--dump-dir", str(tmp_path / "dump-1")])
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 9,
        180,
        "identity established at step 9",
    )
    status = status_of(cluster, job)
    assert status["identical_peers"] == [[0, 2], [1, 3], [2, 0], [3, 1]]
    # Deduplicated: no node holds another rank's data, so the ramdisk holds about one shard.
    assert all(holders == [f"node-{rank}"] for rank, steps in status["held"].items() for holders in steps.values())
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 30, "identity of the last step")
    safe = status_of(cluster, job)["safe_step"]

    fresh = lose_node_and_resume(cluster, job, 1, tmp_path, steps=safe + 6)
    assert_resumed_exactly(job, safe, before, tmp_path)
    restore = status_of(cluster, job)["restore"]
    assert restore["step"] == safe
    assert restore["sources"]["1"] == "peer_distant:node-3"  # rank 3 is rank 1's data-parallel peer
    assert status_of(cluster, job)["ranks"][1]["node"] == fresh.node_id


def test_replicated_job_saving_faster_than_it_replicates_restores_lost_node_and_skips_a_corrupt_replica(
    start_cluster, tmp_path
):
    cluster = start_cluster(replicas=2)
    job = run_job(
        "solo", list(cluster.agents), tmp_path / "solo", [*FAST_SAVES, "--dump-dir", str(tmp_path / "dump-1")]
    )
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 9,
        180,
        "replicated step 9",
    )
    with slowed_pushes(cluster):
        still, lag = safe_step_advances(cluster, job)
    assert still <= ADVANCE_BOUND_SECONDS and lag <= LAG_BOUND_STEPS, (still, lag)
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 30, "replicas caught up")
    status = status_of(cluster, job)
    safe = status["safe_step"]
    assert status["held"]["1"][str(safe)] == ["node-0", "node-1", "node-3"]  # own, close (b0) and distant (b1)
    # Flip one byte in the close replica of rank 1: the restore must skip it and use the distant one.
    replica = os.path.join(cluster.agents[0].root, "jobs", "default", job.job, "mtc", "replicas", "rank-1", str(safe))
    flip_byte(replica)

    fresh = lose_node_and_resume(cluster, job, 1, tmp_path, steps=safe + 6)
    assert_resumed_exactly(job, safe, before, tmp_path)
    restore = status_of(cluster, job)["restore"]
    assert restore["sources"]["1"] == "peer_distant:node-3"
    # Excluded from planning: the corrupt replica, and the lost node's copy if it was still listed.
    assert [safe, 1, "node-0"] in restore["unusable_copies"]
    assert "mtc_corrupt_copies_total 1.0" in scrape(fresh.url)
    assert f"step {safe} copy on node-0 unusable" in open(fresh.log_path).read()


def test_node_lost_while_saving_faster_than_it_replicates_restores_a_step_within_the_bound(start_cluster, tmp_path):
    cluster = start_cluster(replicas=1)
    job = run_job(
        "fast", list(cluster.agents), tmp_path / "fast", [*FAST_SAVES, "--dump-dir", str(tmp_path / "dump-1")]
    )
    job.wait(lambda: status_of(cluster, job)["safe_step"] is not None, 120, "a first safe step")
    with slowed_pushes(cluster):
        still, lag = safe_step_advances(cluster, job)
        # The node is lost the moment the job is: its last round's replicas are what its rank has.
        newest = status_of(cluster, job)["newest_complete_step"]
        job.kill_training()
        before = losses(job.pods)
        agents = replace_node(cluster, job, 1)
    assert still <= ADVANCE_BOUND_SECONDS and lag <= LAG_BOUND_STEPS, (still, lag)
    rerun(job, tmp_path / "dump-2", agents=agents, steps=max(before) + 6)
    restored = by_event(job.pods[0], "restored")[0]["step"]
    assert newest - LAG_BOUND_STEPS <= restored <= max(before), (newest, restored)
    assert_resumed_exactly(job, restored, before, tmp_path)


VALID = object()  # stands for the cluster's real peer token


@pytest.mark.parametrize(
    "path, token, statuses",
    [
        ("/v1/peer/jobs/default/x/steps", None, {401}),
        ("/v1/peer/jobs/default/x/steps", "wrong", {401}),
        ("/v1/peer/jobs/default/x/ranks/0/steps/1/files/..%2F..%2F..%2Fstate.json", VALID, {400}),
        ("/v1/peer/jobs/default/x/ranks/0/steps/1/files/%2Fetc%2Fpasswd", VALID, {400}),
        ("/v1/peer/jobs/..%2F..%2Fetc/x/steps", VALID, {400}),
        ("/v1/peer/jobs/default/nojob/steps", VALID, {404}),
    ],
)
def test_peer_service_refuses_missing_token_and_traversal(start_cluster, tmp_path, path, token, statuses):
    cluster = start_cluster(nodes=1)
    agent = cluster.agents[0]
    # Job x exists on the node, so a refusal comes from the path guard, not from an unknown job.
    kubelet.publish(
        agent.endpoint, str(tmp_path / "pod-x" / "mount"), "x-0", attributes={"job": "x", "nodes": "1", "size": "8Mi"}
    )
    if token is VALID:
        token = open(cluster.token_file).read().strip()
    request = urllib.request.Request(agent.url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code in statuses
    assert b"root" not in err.value.read()


def test_peer_service_over_tls(start_agent, tmp_path):
    cert, key = self_signed_certificate(str(tmp_path / "tls"))
    (tmp_path / "token").write_text("tls-token\n")
    agent = start_agent(
        backend="dir",
        extra_args=[
            "--peer-token-file",
            str(tmp_path / "token"),
            "--peer-tls-cert",
            str(cert),
            "--peer-tls-key",
            str(key),
        ],
    )
    context = ssl.create_default_context(cafile=str(cert))
    request = urllib.request.Request(
        f"https://{agent.listen}/v1/peer/jobs/default/x/steps", headers={"Authorization": "Bearer tls-token"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, context=context)
    assert err.value.code == 404  # reached the peer service, over TLS, with the token
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://{agent.listen}/healthz", timeout=5)


def test_with_peer_grants_replicas_and_a_lost_nodes_restore_run_on_grants_and_the_token_alone_reads_nothing(
    start_cluster, tmp_path
):
    """Coordinator and agents with --peer-grants (issue 40): pushes and the restore's fetch carry the coordinator's
    grants; a holder of the cluster token alone is refused every copy on every node."""
    cluster = start_cluster(replicas=1, peer_grants=True)
    job = run_job(
        "granted", list(cluster.agents), tmp_path / "granted", [*FAST_SAVES, "--dump-dir", str(tmp_path / "dump-1")]
    )
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 5,
        180,
        "a replicated step 5 (its pushes ran on grants)",
    )
    # A restarted coordinator signs with a new key: the agents learn it from its replies and replication goes on.
    safe = status_of(cluster, job)["safe_step"]
    cluster.coordinator.kill()
    cluster.coordinator.start()
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= safe + 3,
        120,
        "replicated steps after the coordinator's restart, on its new key's grants",
    )
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 30, "replicas caught up")
    status = status_of(cluster, job)
    safe = status["safe_step"]
    holders = status["held"]["1"][str(safe)]
    assert len(holders) == 2 and "node-1" in holders, holders  # rank 1's own copy and one replica
    token = open(cluster.token_file).read().strip()
    replica_holder = next(h for h in holders if h != "node-1")
    holder = next(a for a in cluster.agents if a.node_id == replica_holder)
    manifest = f"{holder.url}/v1/peer/jobs/default/{job.job}/ranks/1/steps/{safe}/manifest"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(manifest, headers={"Authorization": f"Bearer {token}"}))
    assert refused.value.code == 403 and json.loads(refused.value.read())["reason"] == "missing"

    fresh = lose_node_and_resume(cluster, job, 1, tmp_path, steps=safe + 6)
    assert_resumed_exactly(job, safe, before, tmp_path)
    restore = status_of(cluster, job)["restore"]
    assert restore["sources"]["1"].endswith(f":{replica_holder}")
    refusals = scrape(holder.url)
    assert 'mtc_peer_grant_refusals_total{reason="missing"} 1.0' in refusals, refusals
    assert "mtc_peer_grant_refusals_total{" not in scrape(fresh.url)  # every fetch of the restore was granted
