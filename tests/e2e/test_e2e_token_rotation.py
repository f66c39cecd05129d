"""The cluster token rotated with no restart, as docs/upgrading.md tells: each process has its own copy of
the Secret, which the kubelet updates at its own moment (``project_secret``). Through the three stages
every report and every replica push keeps succeeding; afterwards the old token is refused everywhere."""

import json
import os
import urllib.error
import urllib.request
import uuid

from prometheus_client.parser import text_string_to_metric_families

from examples.local_cluster import LocalCluster, unmount_all_below
from replicator.wire.messages import PROTOCOL_VERSION
from tests.helpers.agents import publish_pods, save_until_safe, scrape, start_fresh
from tests.helpers.ports import listen_address
from tests.helpers.secrets import project_secret
from tests.helpers.tools import requires_root

NODES = ["node-0", "node-1"]
JOB = "rotate"


def status_code(url: str, token: str, context, body: bytes | None = None) -> int:
    """The HTTP status of a request to ``url`` presenting ``token`` (a POST of ``body``, else a GET)."""
    request = urllib.request.Request(
        url,
        data=body,
        method="POST" if body is not None else "GET",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def failed_pushes(agent) -> float:
    """The agent's ``mtc_replicated_steps_total{result="failed"}``."""
    families = text_string_to_metric_families(scrape(agent.url))
    return sum(
        s.value
        for f in families
        if f.name == "mtc_replicated_steps"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("result") == "failed"
    )


@requires_root
def test_the_token_is_rotated_in_three_stages_without_a_restart_or_a_failed_call(tmp_path):
    cluster = LocalCluster(str(tmp_path / "cluster"), listen_address)
    with open(cluster.token_file, encoding="utf-8") as f:
        old, new = f.read().strip(), uuid.uuid4().hex
    files = {
        "coordinator": cluster.token_file,
        **{node: os.path.join(cluster.workdir, f"token-{node}") for node in NODES},
    }
    for path in files.values():
        project_secret(path, f"{old}\n")
    try:
        cluster.coordinator.start()
        for index, node in enumerate(NODES):
            cluster.add_node(index, token_file=files[node])
        processes = {"coordinator": cluster.coordinator, **dict(zip(NODES, cluster.agents))}
        pids = {name: p.process.pid for name, p in processes.items()}
        targets = publish_pods(cluster.agents, tmp_path / "pods", JOB, "a")
        start_fresh(targets, JOB, nodes=len(NODES), timeout=60, take_markers=True, backup_interval_minutes=60)
        step = 1
        save_until_safe(cluster.coordinator, targets, JOB, step, NODES)

        # Add the new token as a second line; make it the first; remove the old one. Each process's
        # copy changes at its own moment, and a step is saved and replicated between any two changes.
        stages = [
            (f"{old}\n{new}\n", ["coordinator", "node-0", "node-1"]),
            (f"{new}\n{old}\n", ["node-1", "coordinator", "node-0"]),
            (f"{new}\n", ["node-0", "coordinator", "node-1"]),
        ]
        for content, order in stages:
            for name in order:
                project_secret(files[name], content)
                step += 1
                save_until_safe(cluster.coordinator, targets, JOB, step, NODES)

        assert {
            name: p.process.pid for name, p in processes.items() if p.process.poll() is None
        } == pids  # nothing restarted
        assert [failed_pushes(agent) for agent in cluster.agents] == [0, 0]
        # No report (the agent logs "HTTP 401") and no push (the receiver's access log) was refused on the way.
        refused = [
            line
            for agent in cluster.agents
            for line in open(agent.log_path, encoding="utf-8")
            if '" 401 ' in line or "HTTP 401" in line
        ]
        assert refused == []
        coordinator = cluster.coordinator
        report = coordinator.url + "/v1/report"
        empty = json.dumps({"protocol": PROTOCOL_VERSION}).encode()
        assert status_code(report, old, coordinator.ssl_context(), empty) == 401
        assert (
            status_code(report, new, coordinator.ssl_context(), empty) == 400
        )  # past the token: an empty report is refused
        for agent in cluster.agents:
            steps = f"{agent.url}/v1/peer/jobs/default/{JOB}-slice/steps"
            assert (status_code(steps, old, None), status_code(steps, new, None)) == (401, 200)
        with urllib.request.urlopen(
            coordinator.url + f"/v1/status?job={JOB}-slice", context=coordinator.ssl_context()
        ) as response:
            assert json.load(response)["silent_nodes"] == []
    finally:
        cluster.stop()
        unmount_all_below(str(tmp_path))
