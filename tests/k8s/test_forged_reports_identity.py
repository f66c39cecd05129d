"""The forged-report suite (``tests/integration/test_forged_reports.py``) in per-node identity mode (issue 40):
the cluster token alone reports nothing, an agent's token speaks for its own node only, and the bounds and
version refusals still come first, before any token is reviewed with the API server. And an agent, proven,
speaks only for the pods the API server places on its node (issue 48): a fresh UID with a shape of its own, a
real pod of another node, a pod of a job in another namespace change no job's incarnation, ranks, copies, grants
or orders.

The coordinator runs in this process (aiohttp's test server) with ``--kube`` and per-node identity against
the session's real API server; two nodes run a two-rank JobSet job, each holding its own rank's step 5, built
with reports that proved their node, and Y runs a one-rank job of another namespace too. The JobSets' pods are
made by the real controllers and bound by the real scheduler (``tests/helpers/kube/placed_jobs.py``). Tokens are
minted with ``TokenRequest`` for the DaemonSet's pods.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, ServiceAccount
from prometheus_client.parser import text_string_to_metric_families

from replicator.coordinator.api import routes, service
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.kube.kube_config import KubeSettings
from replicator.coordinator.trust.node_identity import NodeIdentitySettings
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
from tests.helpers.kube.placed_jobs import PlacedPod, placed_jobset
from tests.helpers.polling import wait_until
from tests.helpers.reports import node_report, pod_report

NAMESPACE = "mtc-forged"
TEAM = "forged-team"
OTHERS = "forged-others"
LABEL = "mtc.dev/forged-reports-test"
X, Y = NODES = ("forged-x", "forged-y")
IPS = {X: "127.0.0.41", Y: "127.0.0.42"}
URLS = {node: f"http://{ip}:8470" for node, ip in IPS.items()}
CLUSTER_TOKEN = "cluster-token-of-the-forged-suite"
KEY = JobRef(TEAM, "forged-workers")  # JobSet forged, replicatedJob workers: a pod on X, one on Y
OTHER = JobRef(OTHERS, "other-solo")  # JobSet other, replicatedJob solo: one pod, on Y
FILES = {"state/data": (1000, "00000000")}
STEP = 5
HUGE_STEP = 10**9


@pytest.fixture(scope="module")
def cluster(control_plane):
    with agent_cluster(control_plane, NAMESPACE, TEAM, NODES, LABEL) as made:
        yield made


@dataclasses.dataclass(frozen=True)
class Jobs:
    """The API server's pods: job ``KEY``'s by node, and job ``OTHER``'s one (on Y)."""

    pods: dict[str, PlacedPod]
    other: PlacedPod


@pytest.fixture(scope="module")
def jobs(cluster):
    """JobSet ``forged`` in the team's namespace, a pod on X and one on Y, and JobSet ``other`` in namespace
    ``forged-others``, its one pod on Y; deleted after."""
    client = cluster.client
    client.create(Namespace(metadata=ObjectMeta(name=OTHERS)))
    try:
        for namespace in (TEAM, OTHERS):  # the pods' ServiceAccount, which the namespace controller makes
            wait_until(
                lambda ns=namespace: any(
                    a.metadata.name == "default" for a in client.list(ServiceAccount, namespace=ns)
                ),
                30,
                f"namespace {namespace}'s default ServiceAccount",
            )
        with (
            placed_jobset(client, TEAM, "forged", "workers", IPS, {LABEL: "true"}) as victims,
            placed_jobset(client, OTHERS, "other", "solo", {Y: IPS[Y]}, {"kubernetes.io/hostname": Y}) as (other,),
        ):
            yield Jobs({pod.node: pod for pod in victims}, other)
    finally:
        client.delete(Namespace, OTHERS)


@pytest.fixture(scope="module")
def tokens(cluster):
    """Each node's agent token (valid for ten minutes, longer than the module runs)."""
    return {node: mint(cluster.client, daemonset_pod(cluster.client, node)) for node in NODES}


@contextlib.asynccontextmanager
async def serving(cluster, tmp_path, peer_grants: bool = False, node_timeout: float = 1.0):
    """The coordinator with per-node identity and, by default, the shortest node timeout (three 1 s heartbeats):
    its base URL and app."""
    token_file = tmp_path / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN)
    config = CoordinatorConfig(
        "127.0.0.1:0",
        token_file=str(token_file),
        node_timeout_seconds=node_timeout,
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


@pytest.fixture
async def placing(cluster, jobs, tmp_path):
    """The coordinator as ``granting``, with a node timeout (3 s) that a test's requests never outlast by chance."""
    async with serving(cluster, tmp_path, peer_grants=True, node_timeout=3.0) as served:
        yield served


def as_reported(key: JobRef, pod: PlacedPod, incarnation: str | None = None, rank: int | None = None, **fields):
    """``pod`` as its node's agent reports it (indices from its name; its volume sets no shape, so ``nodes`` 1)."""
    suffix = pod.name.rpartition("-")[2]
    return pod_report(
        key, 0, pod.worker, pod.uid, incarnation, rank, nodes=1, suffix=suffix, nodes_given=False, **fields
    )


def pod_of(jobs: Jobs, node: str, incarnation: str | None = None, rank: int | None = None) -> PodReport:
    """Job ``KEY``'s pod on ``node``, as its agent reports it."""
    return as_reported(KEY, jobs.pods[node], incarnation, rank)


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


def job_of(view: ClusterStatus, key: JobRef = KEY) -> JobStatus:
    return next(j for j in view.jobs if (j.namespace, j.job) == (key.namespace, key.job))


def held(view: ClusterStatus, key: JobRef = KEY) -> dict[int, dict[int, tuple[str, ...]]]:
    return job_of(view, key).held


def places(view: ClusterStatus, key: JobRef = KEY) -> dict[int, tuple[str, str]]:
    """Rank -> (node, pod) of the job's incarnation."""
    return {r.rank: (r.node, r.pod) for r in job_of(view, key).ranks}


@dataclasses.dataclass(frozen=True)
class Running:
    """The jobs as ``run_job`` left them: job ``KEY``'s incarnation and each node's rank, job ``OTHER``'s
    incarnation (its rank 0 on Y)."""

    incarnation: str
    rank_of: dict[str, int]
    other: str

    def reports(self, jobs: Jobs) -> dict[str, NodeReport]:
        """What X and Y report while they run the jobs: their pods and their own steps 5."""
        return {
            X: report(X, [pod_of(jobs, X, self.incarnation, self.rank_of[X])], [own(STEP, self.rank_of[X])]),
            Y: report(
                Y,
                [pod_of(jobs, Y, self.incarnation, self.rank_of[Y]), as_reported(OTHER, jobs.other, self.other, 0)],
                [own(STEP, self.rank_of[Y]), HeldStep(OTHER.namespace, OTHER.job, STEP, 0, FILES)],
            ),
        }


async def run_job(base: str, tokens: dict[str, str], jobs: Jobs) -> tuple[str, dict[str, int]]:
    """X and Y run the job's two ranks, each holding its own rank's step 5, every report proven: the
    incarnation and each node's rank (``run_jobs`` for both jobs)."""
    running = await run_jobs(base, tokens, jobs)
    return running.incarnation, running.rank_of


async def run_jobs(base: str, tokens: dict[str, str], jobs: Jobs) -> Running:
    """X and Y run job ``KEY``'s two ranks and Y job ``OTHER``'s one, each node holding its ranks' steps 5, every
    report proven; once the coordinator's watch places their pods (reported again until then)."""
    fresh = {X: [pod_of(jobs, X)], Y: [pod_of(jobs, Y), as_reported(OTHER, jobs.other)]}
    deadline = time.monotonic() + 30
    while True:
        for node in NODES:
            code, body = await post(base, report(node, fresh[node]), tokens[node])
            assert code == 200, body
        view = await status(base)
        if all(
            k in {JobRef(j.namespace, j.job) for j in view.jobs} and job_of(view, k).incarnation for k in (KEY, OTHER)
        ):
            break
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.2)
    running = Running(
        job_of(view).incarnation,
        {node: rank for rank, (node, _) in places(view).items()},
        job_of(view, OTHER).incarnation,
    )
    for node, body in running.reports(jobs).items():
        code, reply = await post(base, body, tokens[node])
        assert code == 200, reply
    view = await status(base)
    assert held(view) == {running.rank_of[X]: {STEP: (X,)}, running.rank_of[Y]: {STEP: (Y,)}}
    assert held(view, OTHER) == {0: {STEP: (Y,)}}
    return running


def every_rank(step: int) -> tuple[HeldStep, ...]:
    """A claim of every rank of ``step``, as own data and as a replica."""
    return tuple(own(step, rank, replica) for rank in (0, 1) for replica in (False, True))


async def test_the_cluster_token_without_a_node_token_reports_nothing(cluster, jobs, coordinator, tokens):
    base, _ = coordinator
    await run_job(base, tokens, jobs)
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


async def test_an_agents_token_cannot_report_as_another_node(cluster, jobs, coordinator, tokens):
    base, _ = coordinator
    _, rank_of = await run_job(base, tokens, jobs)
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


async def test_an_agents_claims_of_ranks_it_was_not_given_are_not_believed(cluster, jobs, coordinator, tokens):
    """X, proven, claims Y's rank's step 5 and a huge step of it, as data and as replicas: its report is taken in
    (it is X's), but no claim of a rank it was not assigned or ordered to hold counts, as in the plain suite."""
    base, _ = coordinator
    incarnation, rank_of = await run_job(base, tokens, jobs)
    before = await status(base)
    untrusted = await metric(base, "mtc_coordinator_untrusted_claims_total")
    refused = {reason: await refusals(base, reason) for reason in ("wrong_node", "missing")}
    pods = [pod_of(jobs, X, incarnation, rank_of[X])]
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


async def test_a_silent_node_is_taken_over_only_by_an_agent_on_it(cluster, jobs, coordinator, tokens, control_plane):
    """X falls silent; its id is claimed from another URL with an expired copy of its own token, a token of
    its pod for another audience, a training pod's token on X and Y's agent token: each refused, X's copies
    and URL kept. Then X's agent (same node name and UID) takes its id over from the new URL."""
    base, app = coordinator
    client = cluster.client
    _, rank_of = await run_job(base, tokens, jobs)
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


async def restore_view(
    base: str, incarnation: str, rank: int, node_token: str | None, key: JobRef = KEY
) -> tuple[int, dict]:
    """A rank's restore view as the agent asks for it (a short long poll), presenting ``node_token``."""
    headers = {"Authorization": f"Bearer {CLUSTER_TOKEN}", **({NODE_TOKEN_HEADER: node_token} if node_token else {})}
    params = {"incarnation": incarnation, "rank": str(rank), "wait": "5"}
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"{base}/v1/jobs/{key.namespace}/{key.job}/restore", params=params, headers=headers
        ) as r:
            return r.status, await r.json(content_type=None)


def check_grant(keys: GrantKeys, key: JobRef, step: int, source: dict, at: str):
    """The claims of a restore source's fetch grant, checked as the agent ``at`` checks it.

    Raises:
      GrantRefused: the grant is not for that fetch at ``at``.
    """
    return keys.check(
        source["grant"],
        allowed=("fetch",),
        namespace=key.namespace,
        job=key.job,
        rank=source["data_rank"],
        step=step,
        node=at,
    )


async def test_with_peer_grants_a_restore_view_and_its_grants_go_only_to_the_ranks_node(
    cluster, jobs, granting, tokens
):
    """Peer grants (issue 40 item 2): replies carry the coordinator's key; a rank's restore view, whose sources carry
    grants, is given only to an agent proving that rank's node, and each grant names that node and the holder."""
    base, app = granting
    code, reply = await post(base, report(X), tokens[X])
    assert code == 200 and reply["grant_key"] == app[routes.SIGNER_KEY].public_key, reply
    incarnation, rank_of = await run_job(base, tokens, jobs)
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
        assert check_grant(keys, KEY, STEP, source, source["holder"]).frm == Y
        with pytest.raises(GrantRefused, match="other node"):  # not to be replayed at another holder
            check_grant(keys, KEY, STEP, source, "forged-z")


async def test_a_ranks_settings_restore_view_and_staging_result_come_only_from_its_node(
    cluster, jobs, coordinator, tokens
):
    """Per-node identity on the routes an agent calls for its ranks: X's token speaks for none of Y's rank."""
    base, _ = coordinator
    incarnation, rank_of = await run_job(base, tokens, jobs)
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


# --- A node speaks only for the pods the API server places on it (issue 48) ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Seen:
    """What an attack must leave as it was.

    Attributes:
      jobs: each job's incarnation, ranks (node, pod), held copies, safe step, backups, step being backed up and
        waiting pods, as ``/v1/status`` says.
      replies: X's and Y's assignments and standing orders (replicate, retain, backup, list_backups, lineages,
        encode), less the push grants' signatures.
      views: each rank's restore view, asked by its own node: the step and each source's tier, holder and rank, and
        the node its grant is made out to.
    """

    jobs: dict[JobRef, tuple]
    replies: dict[str, dict]
    views: dict[tuple[JobRef, int], tuple]


def orders(reply: dict) -> dict:
    """A reply's assignments and standing orders, less the push grants (signed anew for each reply)."""
    kept = {name: reply[name] for name in ("assignments", "retain", "backup", "list_backups", "lineages", "encode")}
    kept["replicate"] = [
        {**order, "targets": [{k: v for k, v in t.items() if k != "grant"} for t in order["targets"]]}
        for order in reply["replicate"]
    ]
    return kept


def granted_to(keys: GrantKeys, key: JobRef, step: int, source: dict) -> str | None:
    """The node a restore source's grant is made out to (checked against the coordinator's key), or None."""
    return None if source["grant"] is None else check_grant(keys, key, step, source, source["holder"]).frm


async def start_restores(base: str, tokens: dict[str, str], jobs: Jobs, running: Running) -> None:
    """Each rank asks for its restore view, as its agent does when its pod starts: the plans are made (step 5),
    and retention protects their step from the next decision pass on (waited for, so that what ``observe`` sees
    stands until something changes it)."""
    view = await status(base)
    for key, incarnation in ((KEY, running.incarnation), (OTHER, running.other)):
        for rank, (node, _) in places(view, key).items():
            code, body = await restore_view(base, incarnation, rank, tokens[node], key)
            assert code == 200 and body["step"] == STEP, body
    deadline = time.monotonic() + 15
    while True:
        retained = []
        for node, body in running.reports(jobs).items():
            code, reply = await post(base, body, tokens[node])
            assert code == 200, reply
            retained += reply["retain"]
        if retained and all(STEP in order["protected"] for order in retained):
            return
        assert time.monotonic() < deadline, retained
        await asyncio.sleep(0.3)


async def observe(base: str, app, tokens: dict[str, str], jobs: Jobs, running: Running) -> Seen:
    """X and Y report as they do while running the jobs; then what ``Seen`` holds."""
    replies = {}
    for node, body in running.reports(jobs).items():
        code, reply = await post(base, body, tokens[node])
        assert code == 200, reply
        replies[node] = orders(reply)
    view = await status(base)
    summary = {}
    for key in (KEY, OTHER):
        job = job_of(view, key)
        summary[key] = (
            job.incarnation,
            places(view, key),
            job.held,
            job.safe_step,
            job.backups,
            job.backup_pending,
            job.waiting_pods,
        )
    keys = GrantKeys()
    keys.learn(app[routes.SIGNER_KEY].public_key)
    views = {}
    for key, incarnation in ((KEY, running.incarnation), (OTHER, running.other)):
        for rank, (node, _) in places(view, key).items():
            code, body = await restore_view(base, incarnation, rank, tokens[node], key)
            assert code == 200, body
            sources = tuple(
                (s["tier"], s["holder"], s["data_rank"], granted_to(keys, key, body["step"], s))
                for s in body["sources"]
            )
            views[(key, rank)] = (body["step"], sources)
    return Seen(summary, replies, views)


async def attack(base: str, tokens: dict[str, str], jobs: Jobs, running: Running, pods, held=()) -> list[dict]:
    """X, proven, lists ``pods`` and claims ``held`` beside its own step 5, three times, Y heartbeating meanwhile;
    then two decision ticks. X's replies."""
    replies = []
    for _ in range(3):
        code, reply = await post(base, report(X, pods, [own(STEP, running.rank_of[X]), *held]), tokens[X])
        assert code == 200, reply
        replies.append(reply)
        code, reply = await post(base, running.reports(jobs)[Y], tokens[Y])
        assert code == 200, reply
    await asyncio.sleep(0.5)
    return replies


def huge(key: JobRef, rank: int) -> HeldStep:
    return HeldStep(key.namespace, key.job, HUGE_STEP, rank, FILES)


@pytest.mark.parametrize("claimed", [KEY, OTHER], ids=["its-own-job", "another-job"])
async def test_a_fresh_uid_claiming_a_job_with_a_shape_of_its_own_changes_nothing(
    cluster, jobs, placing, tokens, claimed, caplog
):
    """X lists, beside its own pod, a pod UID the API server never made, of job ``KEY`` (which X runs a rank of) or
    ``OTHER`` (which it does not), with a shape of its own (``nodes: 1``), and claims a huge step of a rank it does
    not run. Without the placement check the job's incarnation ended within a second and a one-rank one put rank 0
    on X: its restore view's grants, its huge step's retain order and its checksums were X's to give."""
    base, app = placing
    running = await run_jobs(base, tokens, jobs)
    await start_restores(base, tokens, jobs, running)
    before = await observe(base, app, tokens, jobs, running)
    mine = pod_of(jobs, X, running.incarnation, running.rank_of[X])
    fresh = pod_report(claimed, 0, 0, "uid-the-api-server-never-made", nodes=1, suffix="zzzzz")
    rank = running.rank_of[Y] if claimed == KEY else 0
    caplog.set_level(logging.INFO, logger="replicator.coordinator.kube.kube_overlay")
    replies = await attack(base, tokens, jobs, running, [mine, fresh], [huge(claimed, rank)])
    assert [[a["pod_uid"] for a in reply["assignments"]] for reply in replies] == [[mine.pod_uid]] * 3
    assert await observe(base, app, tokens, jobs, running) == before
    assert caplog.text.count("(uid uid-the-api-server-never-made, node forged-x) waits for its place") == 1


async def test_a_real_pod_of_another_node_changes_nothing_even_while_that_node_is_silent(
    cluster, jobs, placing, tokens, caplog
):
    """X lists Y's pods of both jobs (their UIDs, incarnations and ranks) beside its own and claims their ranks' huge
    steps; again once Y has gone silent; then stops listing them. Y, back, is given its pods' ranks as before. Without
    the placement check a silent node's pod was filed under X, and X dropping it ended the job's incarnation."""
    base, app = placing
    running = await run_jobs(base, tokens, jobs)
    await start_restores(base, tokens, jobs, running)
    before = await observe(base, app, tokens, jobs, running)
    mine = pod_of(jobs, X, running.incarnation, running.rank_of[X])
    theirs = [
        pod_of(jobs, Y, running.incarnation, running.rank_of[Y]),
        as_reported(OTHER, jobs.other, running.other, 0),
    ]
    claims = [huge(KEY, running.rank_of[Y]), huge(OTHER, 0)]
    caplog.set_level(logging.WARNING, logger="replicator.coordinator.kube.kube_overlay")
    await attack(base, tokens, jobs, running, [mine, *theirs], claims)
    assert await observe(base, app, tokens, jobs, running) == before
    deadline = time.monotonic() + 10
    while Y not in (await status(base)).silent_nodes:
        assert time.monotonic() < deadline
        code, reply = await post(base, report(X, [mine], [own(STEP, running.rank_of[X])]), tokens[X])
        assert code == 200, reply
        await asyncio.sleep(0.3)
    for pods in ([mine, *theirs], [mine, *theirs], [mine]):  # Y silent: listed, then dropped
        code, reply = await post(base, report(X, pods, [own(STEP, running.rank_of[X]), *claims]), tokens[X])
        assert code == 200 and [a["pod_uid"] for a in reply["assignments"]] == [mine.pod_uid], reply
    await asyncio.sleep(0.5)
    assert await observe(base, app, tokens, jobs, running) == before
    for pod in (jobs.pods[Y], jobs.other):  # each lie logged once
        lie = f"node {X} lists pod {pod.name} (uid {pod.uid}) that the API server places on node {Y}: ignored"
        assert caplog.text.count(lie) == 1


async def test_a_pod_of_a_job_in_another_namespace_changes_nothing(cluster, jobs, placing, tokens):
    """X lists job ``OTHER``'s pod (namespace forged-others, on Y), and its own pod renamed into job ``OTHER`` with a
    shape of its own, claiming ``OTHER``'s rank 0 at a huge step. Without the placement check the renamed pod joined
    ``OTHER``, ended its incarnation and took its rank 0; with it, the pod stays job ``KEY``'s, as the API server
    says."""
    base, app = placing
    running = await run_jobs(base, tokens, jobs)
    await start_restores(base, tokens, jobs, running)
    before = await observe(base, app, tokens, jobs, running)
    renamed = as_reported(OTHER, jobs.pods[X])
    replies = await attack(
        base, tokens, jobs, running, [renamed, as_reported(OTHER, jobs.other, running.other, 0)], [huge(OTHER, 0)]
    )
    expected = (jobs.pods[X].uid, running.incarnation, running.rank_of[X])
    assert [[(a["pod_uid"], a["incarnation"], a["rank"]) for a in r["assignments"]] for r in replies] == [
        [expected]
    ] * 3
    assert await observe(base, app, tokens, jobs, running) == before
