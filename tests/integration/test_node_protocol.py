"""The node agents' side of the Orbax protocol, driven by hand (no training process)."""

import json
import os
import urllib.error
import urllib.request

import pytest

from csi_driver import kubelet
from replicator.local_tier.frameworks.orbax import ERRORS_FILE, FAILED_FILE, JAX_INIT_INFO_FILE, REPLICATOR_FILE
from replicator.wire.messages import PROTOCOL_VERSION
from tests.helpers.agents import rank_of, replicator_yaml
from tests.helpers.polling import wait_until


def publish_job(agents, tmp_path, suffix="a"):
    targets = []
    for i, agent in enumerate(agents):
        target = tmp_path / "pods" / f"{suffix}{i}" / "mount"
        attrs = {"nodes": "4", "slices": "2", "size": "32Mi", "jobset": "hand"}
        kubelet.publish(agent.endpoint, str(target), f"hand-slice-{i // 2}-{i % 2}-{suffix}", attributes=attrs)
        targets.append(target)
    wait_until(lambda: all((t / JAX_INIT_INFO_FILE).exists() for t in targets), 20, "ranks assigned")
    return targets


def yaml_for(rank, **override):
    fields = {"assume-data-parallelism": 2, "peer-ranks": [(rank + 2) % 4], "backup-interval-minutes": 30, **override}
    return replicator_yaml("hand", rank, 4, **fields)


def test_ranks_and_jax_coordinator_address_follow_jobset_order(cluster, tmp_path):
    _, agents = cluster
    targets = publish_job(agents, tmp_path)
    infos = [(t / JAX_INIT_INFO_FILE).read_text() for t in targets]
    assert infos == [f"{r}\n127.0.0.1:8476\n" for r in range(4)]  # rank 0 runs on node 0 (127.0.0.1)


def test_invalid_replicator_yaml_fails_with_field_named_and_agent_keeps_running(cluster, tmp_path):
    _, agents = cluster
    targets = publish_job(agents, tmp_path)
    bad = targets[1]
    (bad / REPLICATOR_FILE).write_text(yaml_for(rank_of(bad), **{"node-rank": 3}))
    wait_until(lambda: (bad / FAILED_FILE).exists(), 20, "replicator.failed written")
    assert "node-rank" in (bad / FAILED_FILE).read_text() and "3" in (bad / FAILED_FILE).read_text()
    assert not (bad / REPLICATOR_FILE).exists()  # Orbax reads replicator.failed once the yaml is gone
    good = targets[0]
    (good / REPLICATOR_FILE).write_text(yaml_for(rank_of(good)))
    wait_until(lambda: not (good / REPLICATOR_FILE).exists(), 20, "replicator.yaml taken")
    assert not (good / FAILED_FILE).exists()
    metrics = urllib.request.urlopen(agents[1].url + "/metrics").read().decode()
    assert 'mtc_replicator_yaml_total{result="rejected"} 1.0' in metrics


def test_unreachable_coordinator_is_a_recoverable_error_and_retried(cluster, tmp_path):
    coordinator, agents = cluster
    targets = publish_job(agents, tmp_path)
    before = coordinator.status("hand-slice")["jobs"][0]["incarnation"]
    coordinator.kill()
    for target in targets:
        (target / REPLICATOR_FILE).write_text(yaml_for(rank_of(target)))
    wait_until(lambda: (targets[0] / ERRORS_FILE).exists(), 20, "the error file written")
    assert "coordinator" in (targets[0] / ERRORS_FILE).read_text()
    assert (targets[0] / REPLICATOR_FILE).exists()  # not consumed: the job keeps waiting
    coordinator.start()
    # Soft state: the restarted coordinator rebuilds the same incarnation from node reports.
    wait_until(lambda: all(not (t / REPLICATOR_FILE).exists() for t in targets), 20, "replicator.yaml taken")
    wait_until(lambda: all(any(n.endswith(".restore") for n in os.listdir(t)) for t in targets), 20, "restore markers")
    assert coordinator.status("hand-slice")["jobs"][0]["incarnation"] == before


def test_coordinator_requires_the_cluster_token_of_callers(start_cluster):
    cluster = start_cluster(nodes=1)
    token = open(cluster.token_file).read().strip()
    for headers, expected in [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": f"Bearer {token}"}, 400),
    ]:
        body = json.dumps({"protocol": PROTOCOL_VERSION}).encode()
        request = urllib.request.Request(
            cluster.coordinator.url + "/v1/report", data=body, method="POST", headers=headers
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, context=cluster.coordinator.ssl_context())
        assert err.value.code == expected  # 400: past the token, an empty report is refused
    # The agent presents the token: its reports got through.
    assert cluster.coordinator.status()["nodes"] == ["node-0"]
