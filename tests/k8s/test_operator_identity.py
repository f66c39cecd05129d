"""Operator identity against a real API server (issue 48): a rollback, its cancel, its preview and status take the
operator's own Kubernetes token, which the coordinator reviews (``TokenReview``), and RBAC decides
(``SubjectAccessReview``: ``create``/``delete`` ``rollbacks.mtc.dev``, ``get`` ``checkpoints.mtc.dev``, in the job's
namespace). The cluster token, which every agent pod holds, rolls nothing back.

The coordinator runs in this process (aiohttp's test server) with ``--kube --operator-identity``, as its own
ServiceAccount bound to ``manifests/coordinator-rbac.yaml``'s rules. The operators' ClusterRoles are
``manifests/operator-rbac.yaml``'s, bound by RoleBindings and a ClusterRoleBinding to ServiceAccounts whose tokens
are minted with ``TokenRequest``. A job in each of two namespaces is in the coordinator's state from reports applied
to it directly (the agents' side has suites of its own); each holds steps 5 and 7, so a rollback to 5 abandons 7.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import yaml
from aiohttp.test_utils import TestServer
from lightkube import ApiError
from lightkube.codecs import load_all_yaml
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import RoleRef, Subject
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.authorization_v1 import SubjectAccessReview
from lightkube.resources.core_v1 import Namespace, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding, RoleBinding

from replicator.coordinator.api import routes, service
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.status import render_status
from replicator.coordinator.kube.kube_config import KubeSettings
from replicator.coordinator.state import ClusterState
from replicator.coordinator.trust import operator_auth
from replicator.wire.messages import HeldStep, JobRef, JobSettings
from replicator.wire.operator import ClusterStatus, RollbackPreview
from tests.helpers import REPO
from tests.helpers.kube.node_tokens import agent_cluster
from tests.helpers.polling import wait_until
from tests.helpers.reports import node_report, pod_report
from tests.helpers.tools import require_tool

AGENTS = "mtc-operators"
A, B = "operators-team-a", "operators-team-b"
JOBS = {A: JobRef(A, "train"), B: JobRef(B, "train")}
NODES = {A: "operators-n1", B: "operators-n2"}
LABEL = "mtc.dev/operator-identity-test"
CLUSTER_TOKEN = "cluster-token-of-the-operator-suite"
OPERATOR_RBAC = REPO / "manifests" / "operator-rbac.yaml"
Rollback = create_namespaced_resource("mtc.dev", "v1", "Rollback", "rollbacks")
SETTINGS = JobSettings((), 1, None, 1)
FILES = {"state/data": (1000, "00000000")}
# Operators, all ServiceAccounts of namespace A: alice may roll back in A (a RoleBinding to mtc-rollback there),
# auditor may read every namespace (a ClusterRoleBinding to mtc-checkpoint-viewer), nobody is bound to nothing, and
# admin-of-b holds the built-in admin role in B (which takes mtc-rollback by aggregation).
ALICE, AUDITOR, NOBODY, ADMIN_OF_B = "alice", "auditor", "nobody", "admin-of-b"


def _user(account: str) -> str:
    return f"system:serviceaccount:{A}:{account}"


def _bind(client, namespace: str | None, role: str, account: str) -> None:
    """Binds ClusterRole ``role`` to ``account`` in ``namespace`` (None: in every namespace)."""
    name = f"{account}-{role}"
    ref = RoleRef(apiGroup="rbac.authorization.k8s.io", kind="ClusterRole", name=role)
    subjects = [Subject(kind="ServiceAccount", name=account, namespace=A)]
    if namespace is None:
        client.create(ClusterRoleBinding(metadata=ObjectMeta(name=name), roleRef=ref, subjects=subjects))
    else:
        client.create(RoleBinding(metadata=ObjectMeta(name=name, namespace=namespace), roleRef=ref, subjects=subjects))


def _allowed(client, account: str, verb: str, resource: str, namespace: str) -> bool:
    """The API server's answer for ``account``, asked as the coordinator asks it."""
    attributes = ResourceAttributes(group="mtc.dev", resource=resource, verb=verb, namespace=namespace, name="train")
    review = SubjectAccessReview(spec=SubjectAccessReviewSpec(user=_user(account), resourceAttributes=attributes))
    return client.create(review).status.allowed


@pytest.fixture(scope="module")
def cluster(control_plane):
    """The coordinator's ServiceAccount and kubeconfig (``agent_cluster``, namespace A its team's), namespace B,
    the operators' ClusterRoles and the operators' ServiceAccounts, bound, with a token each (an hour)."""
    with agent_cluster(control_plane, AGENTS, A, (NODES[A],), LABEL) as made:
        client = made.client
        client.create(Namespace(metadata=ObjectMeta(name=B)))
        shipped = load_all_yaml(OPERATOR_RBAC.read_text())  # the resources' CRDs and the roles
        for obj in shipped:
            client.create(obj)
        for crd in (o for o in shipped if isinstance(o, CustomResourceDefinition)):
            wait_until(lambda: _established(client, crd.metadata.name), 30, f"CRD {crd.metadata.name} established")
        tokens = {}
        for account in (ALICE, AUDITOR, NOBODY, ADMIN_OF_B):
            client.create(ServiceAccount(metadata=ObjectMeta(name=account, namespace=A)))
            request = ServiceAccount.Token(
                metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=3600)
            )
            tokens[account] = client.create(request, account, namespace=A).status.token
        _bind(client, A, "mtc-rollback", ALICE)
        _bind(client, None, "mtc-checkpoint-viewer", AUDITOR)
        _bind(client, B, "admin", ADMIN_OF_B)
        try:
            yield made, tokens
        finally:
            client.delete(ClusterRoleBinding, f"{AUDITOR}-mtc-checkpoint-viewer")
            for obj in shipped:
                client.delete(type(obj), obj.metadata.name)
            client.delete(Namespace, B)


def _established(client, name: str) -> bool:
    conditions = client.get(CustomResourceDefinition, name).status.conditions or ()
    return any(c.type == "Established" and c.status == "True" for c in conditions)


def _running(state: ClusterState, key: JobRef, node: str, now: float) -> None:
    """A one-node job ``key`` on ``node``, its rank 0 holding steps 5 and 7."""
    uid = f"{key.namespace}-uid"
    reply = state.apply_report(node_report(node, [pod_report(key, 0, 0, uid, nodes=1)]), now)
    incarnation = reply.assignments[0].incarnation
    state.restore.settings(key, incarnation, 0, SETTINGS)
    held = [HeldStep(key.namespace, key.job, step, 0, FILES) for step in (5, 7)]
    state.apply_report(node_report(node, [pod_report(key, 0, 0, uid, incarnation, 0, SETTINGS, nodes=1)], held), now)


@pytest.fixture
async def coordinator(cluster, tmp_path):
    """The coordinator with operator identity, on a loopback port, the two jobs running: its base URL and state."""
    made, _ = cluster
    token_file = tmp_path / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN)
    config = CoordinatorConfig(
        "127.0.0.1:0", token_file=str(token_file), kube=KubeSettings(kubeconfig=made.kubeconfig), operator_identity=True
    )
    app = service.make_app(config)
    state = app[routes.STATE_KEY]
    for namespace, key in JOBS.items():
        _running(state, key, NODES[namespace], time.time())
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/"), state


async def call(base: str, method: str, path: str, token: str | None, body: object = None) -> tuple[int, dict]:
    """One request presenting ``token`` as its bearer (none: no header): the status and the JSON body."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, base + path, json=body, headers=headers) as response:
            return response.status, await response.json(content_type=None)


def rollback(namespace: str) -> str:
    return f"/v1/jobs/{namespace}/train/restore-from"


def pending(state: ClusterState) -> dict[str, int | None]:
    """Each job's pending rollback, as status shows it, and that no timeline was begun."""
    assert all(state.job(key).forks == () for key in JOBS.values())
    return {job.namespace: job.pending_rollback for job in state.operator.status().jobs}


def refusals(reason: str) -> float:
    return operator_auth.REFUSALS.labels(reason)._value.get()


async def test_the_cluster_token_alone_rolls_back_nothing_and_cancels_nothing(cluster, coordinator):
    base, state = coordinator
    _, tokens = cluster
    before = refusals("unauthenticated")
    for token in (CLUSTER_TOKEN, None, "not-a-token"):
        code, body = await call(base, "POST", rollback(A), token, {"step": 5})
        assert (code, body["reason"]) == (401, "unauthenticated"), body
    assert "cluster token" in (await call(base, "POST", rollback(A), CLUSTER_TOKEN, {"step": 5}))[1]["error"]
    assert refusals("unauthenticated") == before + 4
    assert pending(state) == {A: None, B: None}
    # An operator's rollback stands against the cluster token's cancel.
    assert (await call(base, "POST", rollback(A), tokens[ALICE], {"step": 5}))[0] == 200
    code, body = await call(base, "DELETE", rollback(A), CLUSTER_TOKEN)
    assert (code, body["reason"]) == (401, "unauthenticated")
    assert state.job(JOBS[A]).forced_step == 5 and pending(state) == {A: 5, B: None}
    for path in ("/v1/status", f"{rollback(A)}?step=5"):
        assert (await call(base, "GET", path, CLUSTER_TOKEN))[0] == 401


async def test_a_rollback_role_bound_in_one_namespace_rolls_back_there_and_is_refused_in_the_other(
    cluster, coordinator, control_plane
):
    base, state = coordinator
    made, tokens = cluster
    alice = tokens[ALICE]
    before = refusals("forbidden")
    code, body = await call(base, "POST", rollback(B), alice, {"step": 5})
    assert (code, body["reason"]) == (403, "forbidden")
    assert body["error"].startswith(f"{_user(ALICE)} may not create rollbacks.mtc.dev/train in namespace {B}")
    assert (await call(base, "GET", f"{rollback(B)}?step=5", alice))[0] == 403
    assert refusals("forbidden") == before + 2
    assert pending(state) == {A: None, B: None}

    code, preview = await call(base, "GET", f"{rollback(A)}?step=5", alice)
    assert code == 200 and [s.step for s in msgspec.convert(preview, RollbackPreview, strict=False).abandoned] == [7]
    assert await call(base, "POST", rollback(A), alice, {"step": 5}) == (200, {"ok": True, "step": 5})
    assert pending(state) == {A: 5, B: None}
    # A rollback pending in B is not alice's to cancel; hers in A is.
    state.operator.force(JOBS[B], 5)
    assert (await call(base, "DELETE", rollback(B), alice))[0] == 403
    assert await call(base, "DELETE", rollback(A), alice) == (200, {"ok": True, "step": 5})
    assert pending(state) == {A: None, B: 5}

    # kubectl answers as the coordinator decides (the CRDs make the resources known to it).
    kubectl = [require_tool("kubectl"), "--kubeconfig", str(control_plane.kubeconfig)]
    for namespace, answer in ((A, "yes"), (B, "no")):
        done = subprocess.run(
            [*kubectl, "auth", "can-i", "create", "rollbacks.mtc.dev/train", "-n", namespace, "--as", _user(ALICE)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (done.stdout.strip(), done.stderr) == (answer, ""), done.stderr
    # The resources exist for RBAC only: creating one does nothing but fail, with a pointer to mtc restore-from.
    with pytest.raises(ApiError, match="for RBAC only; roll back with mtc restore-from"):
        made.client.create(Rollback(metadata=ObjectMeta(name="train", namespace=A)))


async def test_the_admin_role_of_a_namespace_rolls_back_there_through_aggregation(cluster, coordinator):
    base, state = coordinator
    made, tokens = cluster
    # The controller-manager's aggregation controller adds mtc-rollback's rules to the built-in admin role.
    wait_until(lambda: _allowed(made.client, ADMIN_OF_B, "create", "rollbacks", B), 30, "admin aggregated")
    assert await call(base, "POST", rollback(B), tokens[ADMIN_OF_B], {"step": 5}) == (200, {"ok": True, "step": 5})
    assert (await call(base, "POST", rollback(A), tokens[ADMIN_OF_B], {"step": 5}))[0] == 403
    assert pending(state) == {A: None, B: 5}


async def status(base: str, token: str | None, job: str | None = None) -> tuple[int, ClusterStatus | dict]:
    code, body = await call(base, "GET", "/v1/status" + (f"?job={job}" if job else ""), token)
    return code, msgspec.convert(body, ClusterStatus, strict=False) if code == 200 else body


async def test_status_shows_a_caller_only_the_namespaces_it_may_read(cluster, coordinator):
    base, _ = coordinator
    _, tokens = cluster
    code, body = await status(base, None)
    assert (code, body["reason"]) == (401, "unauthenticated")

    _, everything = await status(base, tokens[AUDITOR])  # allowed cluster-wide: every job and node
    assert [(j.namespace, j.job) for j in everything.jobs] == [(A, "train"), (B, "train")]
    assert set(everything.nodes) == set(NODES.values()) and everything.namespaces is None

    _, alices = await status(base, tokens[ALICE])
    assert [j.namespace for j in alices.jobs] == [A] and alices.jobs[0].held == {0: {5: (NODES[A],), 7: (NODES[A],)}}
    assert (alices.nodes, alices.namespaces) == ((), (A,))
    assert render_status(alices).startswith(f"nodes: not shown (you may read some namespaces' jobs only; shown: {A})")
    assert [j.namespace for j in (await status(base, tokens[ALICE], "train"))[1].jobs] == [A]  # a bare name
    assert (await status(base, tokens[ALICE], f"{B}/train"))[0] == 403
    assert (await status(base, tokens[ALICE], f"{B}/missing"))[0] == 403  # refused before it is looked up

    _, nobodys = await status(base, tokens[NOBODY])
    assert (nobodys.jobs, nobodys.nodes, nobodys.namespaces) == ((), (), ())
    code, body = await status(base, tokens[NOBODY], "train")
    assert (code, body["error"]) == (404, "no job named 'train'")


def _kubeconfig(path: Path, made, user: dict) -> str:
    """A kubeconfig of the control plane for ``user`` (a kubeconfig ``user`` entry)."""
    server = yaml.safe_load(Path(made.kubeconfig).read_text())["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": server}],
        "users": [{"name": "operator", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def mtc(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``mtc ARGV`` in a process of its own (the coordinator serves from this event loop meanwhile)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replicator.cli",
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


async def test_mtc_sends_the_kubeconfigs_token_or_its_exec_plugins(cluster, coordinator, control_plane, tmp_path):
    base, state = coordinator
    made, tokens = cluster
    credential = {"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential"}
    credential["status"] = {"token": tokens[ALICE]}
    alice = _kubeconfig(tmp_path / "alice", made, {"token": tokens[ALICE]})
    plugin = _kubeconfig(
        tmp_path / "plugin",
        made,
        {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": sys.executable,
                "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
            }
        },
    )
    coordinator = ["--coordinator", base]

    code, out, err = await mtc(
        "restore-from", *coordinator, "--job", f"{A}/train", "--step", "5", "--yes", "--kubeconfig", alice
    )
    assert code == 0, err
    assert pending(state) == {A: 5, B: None}
    code, out, err = await mtc(
        "restore-from", *coordinator, "--job", f"{B}/train", "--step", "5", "--yes", "--kubeconfig", alice
    )
    assert code == 1 and err.count("\n") == 1 and err.startswith(f"HTTP 403: {_user(ALICE)} may not get checkpoints"), (
        err
    )

    # The exec plugin's token, from $KUBECONFIG as kubectl finds it.
    code, out, err = await mtc(
        "restore-from", *coordinator, "--job", f"{A}/train", "--cancel", env={**os.environ, "KUBECONFIG": plugin}
    )
    assert code == 0, err
    assert pending(state) == {A: None, B: None}
    code, out, err = await mtc("status", *coordinator, "--json", env={**os.environ, "KUBECONFIG": plugin})
    assert code == 0 and [j["namespace"] for j in json.loads(out)["jobs"]] == [A], err

    # A client certificate cannot be passed on: nothing is sent, and the refusal says why, on one line.
    code, out, err = await mtc(
        "restore-from", *coordinator, "--job", f"{A}/train", "--cancel", "--kubeconfig", str(control_plane.kubeconfig)
    )
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("HTTP 401: no bearer token") and "user 'admin'" in err and "a client certificate" in err
    # The cluster token from --token-file is refused like any other non-operator token.
    cluster_token = tmp_path / "cluster-token"
    cluster_token.write_text(CLUSTER_TOKEN)
    code, out, err = await mtc(
        "restore-from", *coordinator, "--job", f"{A}/train", "--step", "5", "--yes", "--token-file", str(cluster_token)
    )
    assert code == 1 and err.startswith("HTTP 401: the cluster token is not an operator's credential"), err
    assert pending(state) == {A: None, B: None}
