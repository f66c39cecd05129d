"""Reports from whoever holds the cluster token, against the real coordinator over HTTPS: a forged
report is neither believed nor able to make real nodes delete or hand out data; bounds hold."""

import json
import os
import re
import time
import urllib.error
import urllib.request

import pytest

from csi_driver import kubelet
from replicator.wire.messages import PROTOCOL_VERSION, HeldStep, NodeReport, PodReport, to_json
from tests.helpers.agents import scrape, start_fresh
from tests.helpers.polling import wait_until
from tests.helpers.reports import node_report
from tests.helpers.steps import commit_step

JOB = "real-slice"


def post_report(cluster, report) -> tuple[int, dict]:
    token = open(cluster.token_file).read().strip()
    body = json.dumps(report if isinstance(report, dict) else to_json(report)).encode()
    request = urllib.request.Request(
        cluster.coordinator.url + "/v1/report",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, context=cluster.coordinator.ssl_context()) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def held(cluster) -> dict[int, dict[int, list[str]]]:
    jobs = cluster.coordinator.status(JOB)["jobs"]
    return {int(r): {int(s): h for s, h in steps.items()} for r, steps in (jobs[0]["held"] if jobs else {}).items()}


def run_real_job(cluster, tmp_path):
    """Two pods of a DP=1 job; each commits steps 1 and 2, replicated to the other node. Step 2 is the
    newest safe step; step 1 is collected once it is (there is no backup tier to keep it for)."""
    targets = []
    for i, agent in enumerate(cluster.agents):
        target = tmp_path / "pods" / str(i) / "mount"
        kubelet.publish(agent.endpoint, str(target), f"real-slice-0-{i}-a", attributes={"nodes": "2", "size": "16Mi"})
        targets.append(target)
    start_fresh(targets, "real", nodes=2, backup_interval_minutes=60)
    for step in (1, 2):
        for target in targets:
            commit_step(target, step, {"state/data": os.urandom(1000), "_CHECKPOINT_METADATA": b"{}"})
        wait_until(
            lambda: all(len(held(cluster).get(r, {}).get(step, ())) == 2 for r in (0, 1)),
            30,
            lambda: f"step {step} held twice per rank: {held(cluster)}",
        )
    wait_until(
        lambda: held(cluster) == {r: {2: held(cluster)[r][2]} for r in (0, 1)},
        30,
        lambda: f"only step 2 held: {held(cluster)}",
    )
    return targets


def forged_claim(node_id: str, url: str) -> NodeReport:
    """An invented node claiming a huge step of every rank, as own data and as replicas."""
    files = {"state/data": (1000, "00000000")}
    claims = tuple(
        HeldStep("default", JOB, 10**9, rank, files, replica) for rank in (0, 1) for replica in (False, True)
    )
    return node_report(node_id, held=claims, url=url, topology={"block": "b0"})


def test_a_forged_claim_of_every_rank_deletes_nothing_and_is_logged_and_counted(start_cluster, tmp_path):
    cluster = start_cluster(nodes=2)
    targets = run_real_job(cluster, tmp_path)
    before = held(cluster)
    # Two invented nodes, so that every rank of step 10^9 seems to have the copies safety asks for.
    # Several report rounds: a believed claim would move the safe step to 10^9 and GC would follow.
    for _ in range(4):
        for ghost, url in (("ghost-a", "http://127.0.0.98:1"), ("ghost-b", "http://127.0.0.99:1")):
            status, _ = post_report(cluster, forged_claim(ghost, url))
            assert status == 200
        time.sleep(1.5)  # a report round or more
    assert all((t / "2" / "state" / "data").exists() for t in targets)
    assert held(cluster) == before and 10**9 not in {s for steps in held(cluster).values() for s in steps}
    assert cluster.coordinator.status(JOB)["jobs"][0]["safe_step"] == 2
    with open(cluster.coordinator.log_path, encoding="utf-8") as log:
        assert "ignoring node ghost-a's claim" in log.read()
    counted = re.search(
        r"^mtc_coordinator_untrusted_claims_total (\S+)$",
        scrape(cluster.coordinator.url, cluster.coordinator.ssl_context()),
        re.MULTILINE,
    )
    assert counted and float(counted[1]) >= 4


def test_a_live_node_id_claimed_from_another_url_is_refused(start_cluster):
    cluster = start_cluster(nodes=1)
    wait_until(lambda: cluster.coordinator.status()["nodes"] == ["node-0"], 20, "node-0 registered")
    status, body = post_report(cluster, node_report("node-0", url="http://127.0.0.66:9"))
    assert status == 409 and "node-0" in body["error"] and "127.0.0.66" in body["error"]
    with open(cluster.coordinator.log_path, encoding="utf-8") as log:
        assert "refused a report" in log.read()


@pytest.mark.parametrize(
    ("shape", "status", "named"),
    [
        ({"files": 20_000}, 200, None),  # over aiohttp's 1 MiB default: a node with many files still reports
        ({"files": 100_001}, 400, "files"),
        ({"nodes": 10**9}, 400, "nodes"),
        ({"held": 16_385}, 400, "held"),
    ],
)
def test_report_sizes_are_bounded_and_named(start_cluster, shape, status, named):
    cluster = start_cluster(nodes=1)
    files = {f"state/d/{i:06d}": (1, "00000000") for i in range(shape.get("files", 1))}
    pods = (PodReport("default", "big", "big-0", "uid", None, None, 4, 1, 8476, "big", 0.0),)
    held = [HeldStep("default", "big", 1, 0, files)]
    report = to_json(node_report("big-node", pods, held, url="http://127.0.0.77:1"))
    report["pods"][0]["nodes"] = shape.get("nodes", 4)
    report["held"] = report["held"] * shape.get("held", 1)
    code, body = post_report(cluster, report)
    assert code == status, body
    if named:
        assert named in body["error"]


@pytest.mark.parametrize("version", [None, 1, PROTOCOL_VERSION + 2])
def test_an_agent_of_a_protocol_version_two_apart_is_refused_with_both_versions_named(start_cluster, version):
    cluster = start_cluster(nodes=1)
    report = to_json(node_report("old-node", url="http://127.0.0.78:1"))
    if version is None:
        del report["protocol"]  # what a version-1 agent sends
    else:
        report["protocol"] = version
        report["held"] = [{"a": "field this version never had"}]  # its message need not even decode
    code, body = post_report(cluster, report)
    assert code == 409, body
    assert f"version {version or 1}" in body["error"] and f"version {PROTOCOL_VERSION}" in body["error"]
    assert "old-node" not in cluster.coordinator.status()["nodes"]


def test_an_agent_one_version_ahead_is_served_its_new_fields_left_out(start_cluster):
    cluster = start_cluster(nodes=1)
    report = to_json(node_report("next-node", url="http://127.0.0.78:1", protocol=PROTOCOL_VERSION + 1))
    report["a_field_of_the_next_version"] = [1, 2, 3]
    code, body = post_report(cluster, report)
    assert code == 200, body
    assert body["protocol"] == PROTOCOL_VERSION
    assert "next-node" in cluster.coordinator.status()["nodes"]
