"""Peer TLS with one certificate every agent shares, as the Helm chart generates it (a name, no pod's
address): real agents serve HTTPS with it and push replicas to each other with ``--peer-tls-check ca``;
with the default ``name`` check the same certificate is refused and no replica lands."""

import os
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.local_cluster import LocalCluster, unmount_all_below
from replicator.wire import tls
from replicator.wire.tls import ServerCheck
from tests.helpers.agents import job_status, publish_pods, save_until_safe, scrape, start_fresh
from tests.helpers.kube.pki import CertificateAuthority
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address
from tests.helpers.steps import commit_step

NODES = ["node-0", "node-1"]
JOB = "peertls"


@pytest.fixture
def tls_cluster(tmp_path):
    """Factory: a coordinator and two agents serving the shared certificate, checking peers with ``check``."""
    (tmp_path / "pki").mkdir()
    ca = CertificateAuthority(tmp_path / "pki", "mtc-peer-ca")
    shared = ca.issue("peer", "mtc-node", dns_names=("mtc-node",))  # names no agent's address
    clusters = []

    def start(check: str) -> tuple[LocalCluster, str]:
        cluster = LocalCluster(
            str(tmp_path / "cluster"),
            listen_address,
            agent_args=[
                *("--peer-tls-cert", str(shared.cert), "--peer-tls-key", str(shared.key)),
                *("--peer-tls-ca", str(ca.pair.cert), "--peer-tls-check", check),
            ],
        )
        clusters.append(cluster)
        return cluster.start(len(NODES)), str(ca.pair.cert)

    yield start
    for cluster in clusters:
        cluster.stop()
    unmount_all_below(str(tmp_path))


def pushes(agent, ca_file: str, result: str) -> float:
    """The agent's ``mtc_replicated_steps_total{result=...}``, scraped over HTTPS."""
    families = text_string_to_metric_families(
        scrape(f"https://{agent.listen}", tls.client_context(ca_file, ServerCheck.CA))
    )
    return sum(
        s.value
        for f in families
        if f.name == "mtc_replicated_steps"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("result") == result
    )


def test_agents_sharing_one_certificate_replicate_over_tls_checking_the_ca_alone(tls_cluster, tmp_path):
    cluster, ca_file = tls_cluster("ca")
    targets = publish_pods(cluster.agents, tmp_path / "pods", JOB, "a")
    start_fresh(targets, JOB, nodes=len(NODES), timeout=60, take_markers=True, backup_interval_minutes=60)
    save_until_safe(cluster.coordinator, targets, JOB, 1, NODES)  # each rank's step on both nodes
    assert [pushes(agent, ca_file, "failed") for agent in cluster.agents] == [0, 0]
    assert all(pushes(agent, ca_file, "ok") >= 1 for agent in cluster.agents)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the HTTP side is HTTPS only
        urllib.request.urlopen(f"http://{cluster.agents[0].listen}/healthz", timeout=5)


def test_the_name_check_refuses_the_shared_certificate(tls_cluster, tmp_path):
    cluster, ca_file = tls_cluster("name")
    targets = publish_pods(cluster.agents, tmp_path / "pods", JOB, "a")
    start_fresh(targets, JOB, nodes=len(NODES), timeout=60, take_markers=True, backup_interval_minutes=60)
    for target in targets:
        commit_step(target, 1, {"state/data": os.urandom(4096), "_CHECKPOINT_METADATA": b"{}"})
    wait_until(
        lambda: all(pushes(agent, ca_file, "failed") >= 1 for agent in cluster.agents),
        60,
        "each agent's push refused",
    )
    held = job_status(cluster.coordinator, f"{JOB}-slice")["held"]
    assert {rank: steps["1"] for rank, steps in held.items()} == {"0": ["node-0"], "1": ["node-1"]}
