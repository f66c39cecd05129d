"""``NodeVerifier`` against a stand-in API server: the order of the checks, the cache until a token's
expiry, and a node recreated under its name (the real API server: ``tests/k8s/test_node_identity.py``)."""

import base64
import json
from types import SimpleNamespace

import pytest
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Node, Pod

from replicator.coordinator.trust.node_identity import (
    IdentityRefused,
    IdentityUnavailable,
    NodeIdentitySettings,
    NodeVerifier,
)

NOW = 1_000_000.0
SETTINGS = NodeIdentitySettings("mtc-system")


def jwt(exp: float = NOW + 600, aud: object = ("mtc-coordinator",), tag: str = "") -> str:
    payload = base64.urlsafe_b64encode(json.dumps({"exp": int(exp), "aud": list(aud), "t": tag}).encode())  # type: ignore[call-overload]
    return f"e30.{payload.rstrip(b'=').decode()}.sig"


class FakeApi:
    """Tokens by their ``t`` claim -> the node they prove; pods and nodes as the API server holds them."""

    def __init__(self):
        self.reviews = 0
        self.node_uids = {"x": "uid-x1", "y": "uid-y1"}
        self.down = False

    async def create(self, review):
        self.reviews += 1
        if self.down:
            raise OSError("connection refused")
        tag = json.loads(base64.urlsafe_b64decode(review.spec.token.split(".")[1] + "=="))["t"]
        node, uid = tag.split("/") if "/" in tag else (tag, self.node_uids.get(tag, "?"))
        account = "system:serviceaccount:team:trainer" if node == "trainer" else "system:serviceaccount:mtc-system:mtc"
        extra = {
            f"authentication.kubernetes.io/{k}": [v]
            for k, v in {
                "node-name": node,
                "node-uid": uid,
                "pod-name": f"mtc-node-{node}",
                "pod-uid": f"pod-{node}",
            }.items()
        }
        user = SimpleNamespace(username=account, extra=extra)
        return SimpleNamespace(
            status=SimpleNamespace(authenticated=True, user=user, audiences=review.spec.audiences, error=None)
        )

    async def get(self, kind, name, *, namespace=None):
        if kind is Pod:
            node = name.removeprefix("mtc-node-")
            owner = SimpleNamespace(controller=True, kind="DaemonSet", name="mtc-node")
            return SimpleNamespace(
                metadata=SimpleNamespace(uid=f"pod-{node}", ownerReferences=[owner]),
                spec=SimpleNamespace(nodeName=node),
            )
        if name not in self.node_uids:
            raise ApiError(status=SimpleNamespace(code=404))  # type: ignore[arg-type]
        assert kind is Node
        return SimpleNamespace(metadata=SimpleNamespace(uid=self.node_uids[name]))


def verifier(api: FakeApi) -> NodeVerifier:
    return NodeVerifier(api, SETTINGS, clock=lambda: NOW)


@pytest.mark.parametrize(
    ("token", "node", "reason"),
    [
        (None, "x", "missing"),
        ("not-a-jwt", "x", "malformed"),
        (jwt(exp=NOW - 1, tag="x"), "x", "expired"),
        (jwt(aud=("api",), tag="x"), "x", "audience"),
        (jwt(tag="trainer"), "trainer", "service_account"),
        (jwt(tag="x"), "y", "wrong_node"),
        (jwt(tag="x/uid-old"), "x", "node"),
    ],
)
async def test_a_report_is_refused_with_its_reason(token, node, reason):
    with pytest.raises(IdentityRefused) as refused:
        await verifier(FakeApi()).admit(token, node)
    assert refused.value.reason == reason


async def test_a_verified_token_is_reviewed_once_until_it_expires():
    api = FakeApi()
    nodes = verifier(api)
    token = jwt(tag="x")
    for _ in range(3):
        assert (await nodes.admit(token, "x")).identity.node_uid == "uid-x1"
    assert api.reviews == 1
    api.down = True  # an API-server outage: the cached token still admits
    assert not (await nodes.admit(token, "x")).replaced
    with pytest.raises(IdentityUnavailable):
        await nodes.admit(jwt(tag="x", exp=NOW + 599), "x")  # a new token must be reviewed


async def test_a_node_recreated_under_its_name_replaces_it_and_its_old_token_is_checked_again():
    api = FakeApi()
    nodes = verifier(api)
    old = jwt(tag="x/uid-x1")
    assert not (await nodes.admit(old, "x")).replaced
    api.node_uids["x"] = "uid-x2"
    assert (await nodes.admit(jwt(tag="x", exp=NOW + 599), "x")).replaced
    with pytest.raises(IdentityRefused) as refused:
        await nodes.admit(old, "x")  # cached with the old UID: reviewed afresh, and the node is gone
    assert refused.value.reason == "node"


@pytest.mark.parametrize(("uid", "reason"), [("pod-x", "pod"), ("uid-x1", "node")])
async def test_a_cached_token_of_a_deleted_pod_or_node_is_refused_at_once_even_in_an_outage(uid, reason):
    api = FakeApi()
    nodes = verifier(api)
    token = jwt(tag="x")
    await nodes.admit(token, "x")
    nodes.deleted(uid)
    api.down = True  # refused from what the watch saw, with no review
    with pytest.raises(IdentityRefused) as refused:
        await nodes.admit(token, "x")
    assert (refused.value.reason, api.reviews) == (reason, 1)
    assert uid in str(refused.value) and "deleted" in str(refused.value)
    api.down = False
    assert (await nodes.admit(jwt(tag="y"), "y")).identity.node_name == "y"  # another node's token still admits
