"""Per-node identity against a real API server (issue 40): an agent's report is admitted only with a
projected ServiceAccount token, minted by ``TokenRequest`` for a pod of the agents' DaemonSet bound
to the report's node.

The coordinator runs in this process (aiohttp's test server) with ``--kube`` and per-node identity,
reading the API server as its own ServiceAccount bound to the rules of ``manifests/coordinator-rbac.yaml``,
so the RBAC those rules grant is exactly what is exercised. The DaemonSet's pods are made by the real
DaemonSet controller and bound by the real scheduler to Node objects with no kubelet behind them.
"""

import asyncio
import contextlib
import time
import uuid

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer
from lightkube import ApiError
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.core_v1 import Node, Pod

from replicator.coordinator.api import routes, service
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.kube.kube_config import KubeSettings
from replicator.coordinator.trust import node_identity
from replicator.coordinator.trust.node_identity import NodeIdentitySettings
from replicator.wire.bearer import Tokens
from replicator.wire.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from replicator.wire.messages import NODE_TOKEN_HEADER, PROTOCOL_VERSION, NodeReport
from tests.helpers.kube import register_node
from tests.helpers.kube.node_tokens import agent_cluster, daemonset_pod, expired_copy, mint
from tests.helpers.secrets import project_secret

NAMESPACE = "mtc-identity"
TEAM = "identity-team"
AUDIENCE = node_identity.DEFAULT_AUDIENCE
LABEL = "mtc.dev/identity-test"
NODES = ("identity-x", "identity-y")
CLUSTER_TOKEN = "cluster-token-of-the-test"
# A deletion reaches the coordinator's watch within moments; a cached token would be admitted for 10 minutes.
WATCH_SECONDS = 10.0


@pytest.fixture(scope="module")
def cluster(control_plane):
    """The agents' namespace, ServiceAccount and DaemonSet (on the nodes labelled ``LABEL`` only), two such
    nodes, a training pod of another ServiceAccount on the first, and the coordinator's kubeconfig."""
    with agent_cluster(control_plane, NAMESPACE, TEAM, NODES, LABEL) as made:
        yield {"client": made.client, "kubeconfig": made.kubeconfig, "trainer": made.trainer, "work": made.work}


@pytest.fixture
async def coordinator(cluster, tmp_path):
    """The coordinator with per-node identity, on a loopback port: its base URL."""
    token_file = tmp_path / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN)
    config = CoordinatorConfig(
        "127.0.0.1:0",
        token_file=str(token_file),
        kube=KubeSettings(kubeconfig=cluster["kubeconfig"]),
        node_identity=NodeIdentitySettings(NAMESPACE),
    )
    app = service.make_app(config)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/"), app


def report_of(node: str, url: str = "http://127.0.0.9:8470") -> NodeReport:
    return NodeReport(node, url, None, {}, (), (), protocol=PROTOCOL_VERSION)


async def post(base: str, node: str, token: str | None, url: str = "http://127.0.0.9:8470") -> tuple[int, dict]:
    """A report of ``node`` presenting ``token``: the status and the JSON body."""
    headers = {"Authorization": f"Bearer {CLUSTER_TOKEN}", **({NODE_TOKEN_HEADER: token} if token else {})}
    async with aiohttp.ClientSession() as session:
        body = msgspec.to_builtins(report_of(node, url))
        async with session.post(f"{base}/v1/report", json=body, headers=headers) as response:
            return response.status, await response.json()


def refusals(reason: str) -> float:
    return node_identity.REFUSALS.labels(reason)._value.get()


async def test_an_agent_of_node_x_reports_for_x_and_not_for_y(cluster, coordinator):
    base, app = coordinator
    token = mint(cluster["client"], daemonset_pod(cluster["client"], NODES[0]))
    status, _ = await post(base, NODES[0], token)
    assert status == 200
    assert NODES[0] in app[routes.STATE_KEY].liveness.nodes
    before = refusals("wrong_node")
    status, body = await post(base, NODES[1], token)
    assert (status, body["reason"]) == (403, "wrong_node")
    assert NODES[0] in body["error"] and NODES[1] in body["error"]
    assert refusals("wrong_node") == before + 1
    assert NODES[1] not in app[routes.STATE_KEY].liveness.nodes


async def test_a_report_without_a_node_token_is_refused(coordinator):
    base, _ = coordinator
    status, body = await post(base, NODES[0], None)
    assert (status, body["reason"]) == (403, "missing")


async def test_an_expired_token_is_refused(cluster, coordinator, control_plane):
    base, _ = coordinator
    token = expired_copy(
        mint(cluster["client"], daemonset_pod(cluster["client"], NODES[0])), control_plane.workdir / "pki" / "sa.key"
    )
    review = cluster["client"].create(TokenReview(spec=TokenReviewSpec(token=token, audiences=[AUDIENCE])))
    assert not review.status.authenticated and "expired" in review.status.error  # the API server's view too
    before = refusals("expired")
    status, body = await post(base, NODES[0], token)
    assert (status, body["reason"]) == (403, "expired")
    assert refusals("expired") == before + 1


async def test_a_training_pods_token_is_refused(cluster, coordinator):
    base, _ = coordinator
    token = mint(cluster["client"], cluster["trainer"], account="trainer")
    status, body = await post(base, NODES[0], token)
    assert (status, body["reason"]) == (403, "service_account")
    assert "system:serviceaccount:identity-team:trainer" in body["error"]


async def test_a_token_for_another_audience_is_refused(cluster, coordinator):
    base, _ = coordinator
    token = mint(cluster["client"], daemonset_pod(cluster["client"], NODES[0]), audience="somebody-else")
    status, body = await post(base, NODES[0], token)
    assert (status, body["reason"]) == (403, "audience")


async def test_a_rotated_token_file_is_used_without_a_restart(cluster, coordinator):
    base, _ = coordinator
    client = cluster["client"]
    path = str(cluster["work"] / f"node-token-{uuid.uuid4().hex}")
    project_secret(path, mint(client, daemonset_pod(client, NODES[0])))
    async with aiohttp.ClientSession() as session:
        agent = CoordinatorClient(session, base, Tokens.of(CLUSTER_TOKEN), Tokens(path))
        await agent.report(report_of(NODES[0]))
        project_secret(path, mint(client, daemonset_pod(client, NODES[1])))  # another node's: proves the file is read
        with pytest.raises(CoordinatorUnavailable, match="HTTP 403.*identity-y"):
            await agent.report(report_of(NODES[0]))
        reviews = node_identity.REVIEWS._value.get()
        project_secret(path, mint(client, daemonset_pod(client, NODES[0])))  # the kubelet's next rotation
        await agent.report(report_of(NODES[0]))
        assert node_identity.REVIEWS._value.get() == reviews + 1  # a new token, reviewed once
        await agent.report(report_of(NODES[0]))
        assert node_identity.REVIEWS._value.get() == reviews + 1  # then cached


async def refused_soon(base: str, node: str, token: str) -> tuple[float, dict]:
    """Reports ``node`` with ``token`` until it is refused (admitted from the cache meanwhile): the seconds it took
    and the refusal's body."""
    started = time.monotonic()
    while True:
        status, body = await post(base, node, token)
        if status != 200:
            assert status == 403, body
            return time.monotonic() - started, body
        assert time.monotonic() - started < WATCH_SECONDS, f"still admitted {WATCH_SECONDS} s after the deletion"
        await asyncio.sleep(0.05)


async def test_a_cached_token_of_a_deleted_agent_pod_is_refused_at_once(cluster, coordinator):
    """The token of an agent pod the watch saw deleted: refused (``pod``) from then on, without a review, though
    cached and unexpired (the DaemonSet makes the node a new pod)."""
    base, _ = coordinator
    client, node = cluster["client"], NODES[1]
    pod = daemonset_pod(client, node)
    token = mint(client, pod)
    assert (await post(base, node, token))[0] == 200
    reviews, refused = node_identity.REVIEWS._value.get(), refusals("pod")
    client.delete(Pod, pod.metadata.name, namespace=NAMESPACE, grace_period=0)
    seconds, body = await refused_soon(base, node, token)
    assert body["reason"] == "pod" and pod.metadata.uid in body["error"] and "deleted" in body["error"], body
    assert (node_identity.REVIEWS._value.get(), refusals("pod")) == (reviews, refused + 1)
    print(f"refused {seconds:.2f} s after the pod's deletion")


async def test_a_cached_token_of_a_deleted_node_is_refused_at_once(cluster, coordinator):
    """A third node, its agent's token admitted and cached, then the Node deleted: refused (``node``) from then on,
    without a review."""
    base, _ = coordinator
    client, node = cluster["client"], "identity-z"
    register_node(client, node, labels={LABEL: "true"})
    try:
        pod = daemonset_pod(client, node)
        token = mint(client, pod)
        assert (await post(base, node, token))[0] == 200
        uid = client.get(Node, node).metadata.uid
        reviews, refused = node_identity.REVIEWS._value.get(), refusals("node")
        client.delete(Node, node)
        seconds, body = await refused_soon(base, node, token)
        assert body["reason"] == "node" and uid in body["error"] and "deleted" in body["error"], body
        assert (node_identity.REVIEWS._value.get(), refusals("node")) == (reviews, refused + 1)
        print(f"refused {seconds:.2f} s after the node's deletion")
    finally:
        with contextlib.suppress(ApiError):
            client.delete(Node, node)
        for orphan in client.list(Pod, namespace=NAMESPACE, fields={"spec.nodeName": node}):
            client.delete(Pod, orphan.metadata.name, namespace=NAMESPACE, grace_period=0)


async def test_a_node_recreated_under_its_name_is_admitted_and_replaces_the_old_one(cluster, coordinator):
    """Runs last: it replaces ``identity-x``."""
    base, app = coordinator
    client, node = cluster["client"], NODES[0]
    old_pod = daemonset_pod(client, node)
    old_token = mint(client, old_pod)
    status, _ = await post(base, node, old_token, url="http://127.0.0.9:8470")
    assert status == 200
    old_uid = client.get(Node, node).metadata.uid
    client.delete(Node, node)
    client.delete(Pod, old_pod.metadata.name, namespace=NAMESPACE, grace_period=0)
    register_node(client, node, labels={LABEL: "true"})
    assert client.get(Node, node).metadata.uid != old_uid
    new_token = mint(client, daemonset_pod(client, node))
    # From another address while the old node is still live: a plain second claimant would get 409.
    status, body = await post(base, node, new_token, url="http://127.0.0.10:8470")
    assert status == 200, body
    assert app[routes.STATE_KEY].liveness.nodes[node].report.url == "http://127.0.0.10:8470"
    status, body = await post(base, node, old_token, url="http://127.0.0.9:8470")  # the old node's token, cached
    assert status == 403 and body["reason"] in ("unauthenticated", "pod", "node"), body
