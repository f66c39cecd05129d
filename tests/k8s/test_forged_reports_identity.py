"""The forged-report suite (``tests/integration/test_forged_reports.py``) in per-node identity mode (issue 40):
the cluster token alone reports nothing, an agent's token speaks for its own node only, and the bounds and
version refusals still come first, before any token is reviewed with the API server.

The coordinator runs in this process (aiohttp's test server) with ``--kube`` and per-node identity against
the session's real API server; two nodes run a two-rank job, each holding its own rank's step 5, built
with reports that proved their node. Tokens are minted with ``TokenRequest`` for the DaemonSet's pods.
"""

import asyncio
import contextlib
import logging
import time

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from replicator.coordinator import routes, service
from replicator.coordinator.config import CoordinatorConfig
from replicator.coordinator.kube_config import KubeSettings
from replicator.coordinator.node_identity import NodeIdentitySettings
from replicator.wire.grants import GrantKeys, GrantRefused
from replicator.wire.messages import (
    NODE_TOKEN_HEADER,
    PROTOCOL_VERSION,
    HeldStep,
    JobRef,
    JobSettings,
    NodeReport,
    PodReport,
    SettingsRequest,
    StagedReport,
    to_json,
)
from replicator.wire.operator import ClusterStatus, JobStatus
from tests.helpers.kube.node_tokens import agent_cluster, daemonset_pod, expired_copy, mint
from tests.helpers.reports import node_report, pod_report

NAMESPACE = "mtc-forged"
TEAM = "forged-team"
LABEL = "mtc.dev/forged-reports-test"
X, Y = NODES = ("forged-x", "forged-y")
URLS = {X: "http://127.0.0.41:8470", Y: "http://127.0.0.42:8470"}
CLUSTER_TOKEN = "cluster-token-of-the-forged-suite"
KEY = JobRef("default", "forged")
FILES = {"state/data": (1000, "00000000")}
STEP = 5
HUGE_STEP = 10**9


@pytest.fixture(scope="module")
def cluster(control_plane):
    with agent_cluster(control_plane, NAMESPACE, TEAM, NODES, LABEL) as made:
        yield made


@pytest.fixture(scope="module")
def tokens(cluster):
    """Each node's agent token (valid for ten minutes, longer than the module runs)."""
    return {node: mint(cluster.client, daemonset_pod(cluster.client, node)) for node in NODES}


@contextlib.asynccontextmanager
async def serving(cluster, tmp_path, peer_grants: bool = False):
    """The coordinator with per-node identity and the shortest node timeout (three 1 s heartbeats): its base
    URL and app."""
    token_file = tmp_path / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN)
    config = CoordinatorConfig(
        "127.0.0.1:0",
        token_file=str(token_file),
        node_timeout_seconds=1.0,
        kube=KubeSettings(kubeconfig=cluster.kubeconfig),
        node_identity=NodeIdentitySettings(NAMESPACE),
        peer_grants=peer_grants,
    )
    app = service.make_app(config)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/"), app


@pytest.fixture
async def coordinator(cluster, tmp_path):
    async with serving(cluster, tmp_path) as served:
        yield served


@pytest.fixture
async def granting(cluster, tmp_path):
    """The coordinator as ``coordinator``, signing peer grants (``--peer-grants``)."""
    async with serving(cluster, tmp_path, peer_grants=True) as served:
        yield served


def pod_of(index: int, incarnation: str | None = None, rank: int | None = None) -> PodReport:
    return pod_report(KEY, 0, index, f"forged-uid-{index}", incarnation, rank, nodes=2)


def report(node: str, pods=(), held=(), url: str | None = None, **fields) -> NodeReport:
    return node_report(node, pods, held, url=url or URLS[node], pod_address="127.0.0.1", **fields)


def own(step: int, rank: int, replica: bool = False) -> HeldStep:
    return HeldStep(KEY.namespace, KEY.job, step, rank, FILES, replica)


async def post(
    base: str, body: NodeReport | dict, node_token: str | None, cluster_token: str | None = CLUSTER_TOKEN
) -> tuple[int, dict]:
    """A report presenting ``node_token`` (none: no header): the status and the JSON body."""
    headers = {
        **({"Authorization": f"Bearer {cluster_token}"} if cluster_token else {}),
        **({NODE_TOKEN_HEADER: node_token} if node_token else {}),
    }
    payload = body if isinstance(body, dict) else to_json(body)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v1/report", json=payload, headers=headers) as response:
            return response.status, await response.json(content_type=None)


async def status(base: str) -> ClusterStatus:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v1/status") as response:
            assert response.status == 200
            return msgspec.json.decode(await response.read(), type=ClusterStatus)


async def metric(base: str, name: str, **labels: str) -> float:
    """A sample of the coordinator's ``/metrics`` page (0 when absent)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as response:
            text = await response.text()
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return next((s.value for s in samples if s.name == name and s.labels == labels), 0.0)


async def refusals(base: str, reason: str) -> float:
    return await metric(base, "mtc_coordinator_identity_refusals_total", reason=reason)


async def reviews(base: str) -> float:
    return await metric(base, "mtc_coordinator_identity_reviews_total")


def job_of(view: ClusterStatus) -> JobStatus:
    return next(j for j in view.jobs if (j.namespace, j.job) == (KEY.namespace, KEY.job))


def held(view: ClusterStatus) -> dict[int, dict[int, tuple[str, ...]]]:
    return job_of(view).held


def places(view: ClusterStatus) -> dict[int, tuple[str, str]]:
    """Rank -> (node, pod) of the job's incarnation."""
    return {r.rank: (r.node, r.pod) for r in job_of(view).ranks}


async def run_job(base: str, tokens: dict[str, str]) -> tuple[str, dict[str, int]]:
    """X and Y run the job's two ranks, each holding its own rank's step 5, every report proven: the
    incarnation and each node's rank."""
    for index, node in enumerate(NODES):
        code, body = await post(base, report(node, [pod_of(index)]), tokens[node])
        assert code == 200, body
    view = await status(base)
    incarnation = job_of(view).incarnation
    assert incarnation is not None, view
    rank_of = {node: rank for rank, (node, _) in places(view).items()}
    for index, node in enumerate(NODES):
        pods = [pod_of(index, incarnation, rank_of[node])]
        code, body = await post(base, report(node, pods, [own(STEP, rank_of[node])]), tokens[node])
        assert code == 200, body
    assert held(await status(base)) == {rank_of[X]: {STEP: (X,)}, rank_of[Y]: {STEP: (Y,)}}
    return incarnation, rank_of


def every_rank(step: int) -> tuple[HeldStep, ...]:
    """A claim of every rank of ``step``, as own data and as a replica."""
    return tuple(own(step, rank, replica) for rank in (0, 1) for replica in (False, True))


async def test_the_cluster_token_without_a_node_token_reports_nothing(cluster, coordinator, tokens):
    base, _ = coordinator
    await run_job(base, tokens)
    before = await status(base)
    missing = await refusals(base, "missing")
    forged = [
        report("ghost-a", held=every_rank(HUGE_STEP), url="http://127.0.0.98:1"),  # the plain suite's invented node
        report(X, held=every_rank(HUGE_STEP)),  # a real node's id, claiming every rank
        report(Y),  # a real node's id, unpublishing its pod and dropping its copy
    ]
    for body in forged:
        code, reply = await post(base, body, None)
        assert (code, reply["reason"]) == (403, "missing"), reply
        assert "node token" in reply["error"]
    assert await refusals(base, "missing") == missing + len(forged)
    assert await status(base) == before  # nodes, ranks and held steps as they were
    # And the other way round: an agent's own token without the cluster token is not let in either.
    code, _ = await post(base, report(X), tokens[X], cluster_token=None)
    assert code == 401
    assert await status(base) == before


async def test_an_agents_token_cannot_report_as_another_node(cluster, coordinator, tokens):
    base, _ = coordinator
    _, rank_of = await run_job(base, tokens)
    before = await status(base)
    wrong, reviewed = await refusals(base, "wrong_node"), await reviews(base)
    attempts = [
        report(Y),  # Y's pod unpublished and its step 5 dropped
        report(Y, held=every_rank(HUGE_STEP)),  # Y claiming every rank of a huge step
        report(Y, url=URLS[X]),  # Y's id moved to X's URL
    ]
    for body in attempts:
        code, reply = await post(base, body, tokens[X])
        assert (code, reply["reason"]) == (403, "wrong_node"), reply
        assert X in reply["error"] and Y in reply["error"]
    assert await refusals(base, "wrong_node") == wrong + len(attempts)
    assert await reviews(base) == reviewed  # X's token was reviewed already: refused from the cache, at no API cost
    after = await status(base)
    assert after == before
    assert places(after)[rank_of[Y]][0] == Y and held(after)[rank_of[Y]] == {STEP: (Y,)}


async def test_an_agents_claims_of_ranks_it_was_not_given_are_not_believed(cluster, coordinator, tokens):
    """X, proven, claims Y's rank's step 5 and a huge step of it, as data and as replicas: its report is taken in
    (it is X's), but no claim of a rank it was not assigned or ordered to hold counts, as in the plain suite."""
    base, _ = coordinator
    incarnation, rank_of = await run_job(base, tokens)
    before = await status(base)
    untrusted = await metric(base, "mtc_coordinator_untrusted_claims_total")
    refused = {reason: await refusals(base, reason) for reason in ("wrong_node", "missing")}
    pods = [pod_of(0, incarnation, rank_of[X])]
    others = tuple(own(step, rank_of[Y], replica) for step in (STEP, HUGE_STEP) for replica in (False, True))
    claims = (own(STEP, rank_of[X]), *others)
    for _ in range(3):
        code, reply = await post(base, report(X, pods, claims), tokens[X])
        assert code == 200, reply
    await asyncio.sleep(0.5)  # two decision ticks
    after = await status(base)
    assert held(after) == held(before) and places(after) == places(before)
    assert HUGE_STEP not in {s for steps in held(after).values() for s in steps}
    assert await metric(base, "mtc_coordinator_untrusted_claims_total") == untrusted + len(others)  # each once
    assert {reason: await refusals(base, reason) for reason in refused} == refused


async def test_an_agent_listing_another_nodes_pod_takes_nothing(cluster, coordinator, tokens):
    """X, proven, lists Y's pod (its uid, incarnation and rank) as its own, then stops listing it."""
    base, _ = coordinator
    incarnation, rank_of = await run_job(base, tokens)
    before = await status(base)
    mine, theirs = pod_of(0, incarnation, rank_of[X]), pod_of(1, incarnation, rank_of[Y])
    for pods in ([mine, theirs], [mine]):
        code, reply = await post(base, report(X, pods, [own(STEP, rank_of[X])]), tokens[X])
        assert code in (200, 403, 409), reply  # taken in without Y's pod, or refused: either leaves Y's pod alone
    code, reply = await post(base, report(Y, [theirs], [own(STEP, rank_of[Y])]), tokens[Y])
    assert code == 200, reply
    assert [a["pod_uid"] for a in reply["assignments"]] == [theirs.pod_uid]
    after = await status(base)
    job = job_of(after)
    assert (job.incarnation, job.waiting_pods, places(after)) == (incarnation, 0, places(before))


async def test_a_live_nodes_id_from_another_url_is_refused_even_with_its_own_token(
    cluster, coordinator, tokens, caplog
):
    base, app = coordinator
    code, _ = await post(base, report(X), tokens[X])
    assert code == 200
    caplog.set_level(logging.WARNING, logger=routes.__name__)
    code, body = await post(base, report(X, url="http://127.0.0.66:9"), tokens[X])
    assert code == 409, body
    assert X in body["error"] and "127.0.0.66" in body["error"]
    assert "refused a report" in caplog.text
    assert app[routes.STATE_KEY].liveness.nodes[X].report.url == URLS[X]


@pytest.mark.parametrize(
    ("shape", "code", "named"),
    [
        ({"files": 20_000}, 200, None),  # over aiohttp's 1 MiB default: a node with many files still reports
        ({"files": 100_001}, 400, "files"),
        ({"nodes": 10**9}, 400, "nodes"),
        ({"held": 16_385}, 400, "held"),
    ],
)
async def test_report_sizes_are_bounded_before_the_token_is_reviewed(cluster, coordinator, shape, code, named):
    """Each report presents a token never reviewed: a refused one costs the API server nothing."""
    base, _ = coordinator
    token = mint(cluster.client, daemonset_pod(cluster.client, X))
    files = {f"state/d/{i:06d}": (1, "00000000") for i in range(shape.get("files", 1))}
    pods = (PodReport("default", "big", "big-0", "uid", None, None, 4, 1, 8476, "big", 0.0),)
    body = to_json(node_report(X, pods, [HeldStep("default", "big", 1, 0, files)], url=URLS[X]))
    body["pods"][0]["nodes"] = shape.get("nodes", 4)
    body["held"] = body["held"] * shape.get("held", 1)
    reviewed = await reviews(base)
    answer, reply = await post(base, body, token)
    assert answer == code, reply
    if named:
        assert named in reply["error"]
        assert await reviews(base) == reviewed
        assert X not in (await status(base)).nodes
    else:
        assert await reviews(base) == reviewed + 1
        assert X in (await status(base)).nodes


@pytest.mark.parametrize("version", [None, 1, PROTOCOL_VERSION + 2])
async def test_an_agent_of_a_protocol_version_two_apart_is_refused_before_the_token_is_reviewed(
    cluster, coordinator, version
):
    base, _ = coordinator
    token = mint(cluster.client, daemonset_pod(cluster.client, X))
    body = to_json(report(X))
    if version is None:
        del body["protocol"]  # what a version-1 agent sends
    else:
        body["protocol"] = version
        body["held"] = [{"a": "field this version never had"}]  # its message need not even decode
    reviewed = await reviews(base)
    code, reply = await post(base, body, token)
    assert code == 409, reply
    assert f"version {version or 1}" in reply["error"] and f"version {PROTOCOL_VERSION}" in reply["error"]
    assert await reviews(base) == reviewed
    assert X not in (await status(base)).nodes


async def test_an_agent_one_version_ahead_is_served_once_proven(coordinator, tokens):
    base, _ = coordinator
    body = to_json(report(X, protocol=PROTOCOL_VERSION + 1))
    body["a_field_of_the_next_version"] = [1, 2, 3]
    code, reply = await post(base, body, tokens[X])
    assert code == 200, reply
    assert reply["protocol"] == PROTOCOL_VERSION
    assert X in (await status(base)).nodes
    code, reply = await post(base, body, None)  # the same report, unproven
    assert (code, reply["reason"]) == (403, "missing")


async def test_a_silent_node_is_taken_over_only_by_an_agent_on_it(cluster, coordinator, tokens, control_plane):
    """X falls silent; its id is claimed from another URL with an expired copy of its own token, a token of
    its pod for another audience, a training pod's token on X and Y's agent token: each refused, X's copies
    and URL kept. Then X's agent (same node name and UID) takes its id over from the new URL."""
    base, app = coordinator
    client = cluster.client
    _, rank_of = await run_job(base, tokens)
    pod = daemonset_pod(client, X)
    elsewhere = "http://127.0.0.43:8470"
    claimants = {
        "expired": expired_copy(tokens[X], control_plane.workdir / "pki" / "sa.key"),
        "audience": mint(client, pod, audience="somebody-else"),
        "service_account": mint(client, cluster.trainer, account="trainer"),
        "wrong_node": tokens[Y],
    }
    deadline = time.monotonic() + 8
    while X not in (await status(base)).silent_nodes:  # three missed 1 s heartbeats
        assert time.monotonic() < deadline, await status(base)
        await asyncio.sleep(0.2)
    before = await status(base)
    counted = {reason: await refusals(base, reason) for reason in claimants}
    for reason, token in claimants.items():
        code, reply = await post(base, report(X, url=elsewhere), token)  # no pods, no copies: would drop X's
        assert (code, reply["reason"]) == (403, reason), reply
    assert {reason: await refusals(base, reason) for reason in claimants} == {r: n + 1 for r, n in counted.items()}
    after = await status(base)
    assert X in after.silent_nodes and held(after) == held(before) == {
        rank_of[X]: {STEP: (X,)},
        rank_of[Y]: {STEP: (Y,)},
    }
    assert app[routes.STATE_KEY].liveness.nodes[X].report.url == URLS[X]
    code, reply = await post(base, report(X, url=elsewhere), tokens[X])
    assert code == 200, reply
    assert app[routes.STATE_KEY].liveness.nodes[X].report.url == elsewhere
    assert X in (await status(base)).nodes


async def post_job(base: str, route: str, body, node_token: str | None) -> tuple[int, dict]:
    """A rank's POST to the job's ``route`` (``settings`` or ``restore``) presenting ``node_token``."""
    headers = {"Authorization": f"Bearer {CLUSTER_TOKEN}", **({NODE_TOKEN_HEADER: node_token} if node_token else {})}
    async with aiohttp.ClientSession() as session:
        url = f"{base}/v1/jobs/{KEY.namespace}/{KEY.job}/{route}"
        async with session.post(url, json=to_json(body), headers=headers) as response:
            return response.status, await response.json(content_type=None)


async def restore_view(base: str, incarnation: str, rank: int, node_token: str | None) -> tuple[int, dict]:
    """A rank's restore view as the agent asks for it (a short long poll), presenting ``node_token``."""
    headers = {"Authorization": f"Bearer {CLUSTER_TOKEN}", **({NODE_TOKEN_HEADER: node_token} if node_token else {})}
    params = {"incarnation": incarnation, "rank": str(rank), "wait": "5"}
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"{base}/v1/jobs/{KEY.namespace}/{KEY.job}/restore", params=params, headers=headers
        ) as r:
            return r.status, await r.json(content_type=None)


async def test_with_peer_grants_a_restore_view_and_its_grants_go_only_to_the_ranks_node(cluster, granting, tokens):
    """Peer grants (issue 40 item 2): replies carry the coordinator's key; a rank's restore view, whose sources carry
    grants, is given only to an agent proving that rank's node, and each grant names that node and the holder."""
    base, app = granting
    code, reply = await post(base, report(X), tokens[X])
    assert code == 200 and reply["grant_key"] == app[routes.SIGNER_KEY].public_key, reply
    incarnation, rank_of = await run_job(base, tokens)
    keys = GrantKeys()
    keys.learn(reply["grant_key"])
    rank = rank_of[Y]
    wrong = await refusals(base, "wrong_node")
    for token, reason in ((tokens[X], "wrong_node"), (None, "missing")):
        code, body = await restore_view(base, incarnation, rank, token)
        assert (code, body.get("reason")) == (403, reason), body
    assert await refusals(base, "wrong_node") == wrong + 1
    code, view = await restore_view(base, incarnation, rank, tokens[Y])
    assert code == 200 and view["step"] == STEP, view
    sources = [s for s in view["sources"] if s["tier"] != "backup"]
    assert sources, view
    for source in sources:

        def check(at: str, source=source):
            return keys.check(
                source["grant"],
                allowed=("fetch",),
                namespace=KEY.namespace,
                job=KEY.job,
                rank=source["data_rank"],
                step=STEP,
                node=at,
            )

        assert check(source["holder"]).frm == Y
        with pytest.raises(GrantRefused, match="other node"):  # not to be replayed at another holder
            check("forged-z")


async def test_a_ranks_settings_restore_view_and_staging_result_come_only_from_its_node(cluster, coordinator, tokens):
    """Per-node identity on the routes an agent calls for its ranks: X's token speaks for none of Y's rank."""
    base, _ = coordinator
    incarnation, rank_of = await run_job(base, tokens)
    rank = rank_of[Y]
    settings = SettingsRequest(incarnation, rank, JobSettings((), 1, None, 100))
    staged = StagedReport(incarnation, "forged-generation", rank, "local:forged-x")
    wrong = await refusals(base, "wrong_node")
    for token, reason in ((tokens[X], "wrong_node"), (None, "missing")):
        assert [
            (code, body.get("reason"))
            for code, body in (
                await post_job(base, "settings", settings, token),
                await restore_view(base, incarnation, rank, token),
                await post_job(base, "restore", staged, token),
            )
        ] == [(403, reason)] * 3
    assert await refusals(base, "wrong_node") == wrong + 3
    code, body = await post_job(base, "settings", settings, tokens[Y])
    assert code == 200, body
    code, view = await restore_view(base, incarnation, rank, tokens[Y])
    assert code == 200 and view["step"] == STEP, view
    assert all(source["grant"] is None for source in view["sources"]), view  # this coordinator signs no grants
