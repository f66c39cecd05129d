"""Per-node identity: a node agent proves which node it runs on before its report is taken in.

Each agent presents a projected ServiceAccount token (``NODE_TOKEN_HEADER``) that the kubelet minted for
the agent's pod, with the coordinator's audience and a short expiry. Since Kubernetes 1.32 (beta in
1.30) such a token names its pod and the node the pod is bound to, and the node authorizer lets a
kubelet ask only for tokens of pods on its own node. ``NodeVerifier`` admits a report when:

1. the token reviews (``TokenReview``) as the agents' ServiceAccount, for our audience;
2. the bound pod exists with that UID, is controlled by the agents' DaemonSet, and runs on the node
   the token names (the API server does not check the node again at review time, so we do, as
   SPIRE's ``k8s_psat`` attestor does);
3. that node exists with the UID the token names;
4. the report's node id is that node's name.

A verified token is cached until its own expiry (a short-lived token: the chart asks for 10 minutes),
so a heartbeat costs one hash, and reports go on through an API-server outage. A node recreated
under the same name (a new UID) is a new node: the first report proven from it replaces the old one
(``Admission.replaced``), and a cached token of the old node is checked afresh, and refused. A token
whose pod or node the coordinator's watch saw deleted (``deleted``) is refused at once, cached or not.

Every refusal is an ``IdentityRefused`` with a reason (``REASONS``), counted in
``mtc_coordinator_identity_refusals_total``.
"""

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.core_v1 import Node, Pod
from prometheus_client import Counter

log = logging.getLogger(__name__)

# The audience the agents' projected token is minted for (the chart's ``nodeIdentity.audience``).
DEFAULT_AUDIENCE = "mtc-coordinator"
# The keys of a pod-bound ServiceAccount token's ``user.extra`` in a TokenReview.
_EXTRA = "authentication.kubernetes.io/"
# Why a report's identity was refused: the ``reason`` of the 403 body and of the metric.
REASONS = (
    "missing",  # no token presented
    "malformed",  # not a JWT with a JSON payload
    "expired",  # its ``exp`` is past
    "audience",  # not minted for our audience
    "unauthenticated",  # the API server did not authenticate it (revoked, bound pod gone, forged)
    "service_account",  # another ServiceAccount's token (a training pod's, say)
    "no_node",  # no pod or node claim (a Secret-based token, or a cluster before ServiceAccountTokenPodNodeInfo)
    "pod",  # the bound pod is gone, replaced, not the agents' DaemonSet's, or on another node
    "node",  # the node is gone or was recreated (another UID)
    "wrong_node",  # the report speaks for another node than the token's
)
REFUSALS = Counter(
    "mtc_coordinator_identity_refusals_total",
    "Node reports refused because their agent could not prove its node, by reason",
    ["reason"],
)
REVIEWS = Counter("mtc_coordinator_identity_reviews_total", "Node tokens reviewed with the API server (cache misses)")
# Verified tokens kept at most (a cluster's agents hold about one each, two across a rotation).
MAX_CACHED = 200_000
# UIDs of deleted agent pods and nodes kept at most (a rollout of 10,000 agents deletes 10,000 pods): one evicted
# here is refused by the API server's own review once its tokens leave the cache (expired, or recreated node).
MAX_DELETED = 200_000


class IdentityRefused(Exception):
    """A report's agent did not prove that it runs on the report's node.

    Attributes:
      reason: one of ``REASONS``.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class IdentityUnavailable(Exception):
    """The API server could not be asked (down, or refused us): the report may be retried."""


@dataclasses.dataclass(frozen=True)
class NodeIdentitySettings:
    """Whose tokens prove a node (``mtc coordinator --node-identity``).

    Attributes:
      namespace: the namespace of the agents' DaemonSet and ServiceAccount.
      service_account: the agents' ServiceAccount.
      daemonset: the agents' DaemonSet: a token's pod must be one of its pods.
      audience: the audience the agents' tokens are minted for.
    """

    namespace: str
    service_account: str = "mtc"
    daemonset: str = "mtc-node"
    audience: str = DEFAULT_AUDIENCE


@dataclasses.dataclass(frozen=True)
class NodeIdentity:
    """What a verified token proves: the agent's pod and the node it runs on (names and UIDs)."""

    node_name: str
    node_uid: str
    pod_name: str
    pod_uid: str


@dataclasses.dataclass(frozen=True)
class Admission:
    """A report's identity, admitted.

    Attributes:
      identity: the agent's pod and node.
      replaced: the node's name was last admitted with another UID: that node is gone, and what the
        coordinator knows of it must be forgotten.
    """

    identity: NodeIdentity
    replaced: bool


class KubeApi(Protocol):
    """The part of lightkube's ``AsyncClient`` the verifier uses."""

    async def create(self, obj: Any) -> Any: ...
    async def get(self, res: Any, name: str, *, namespace: str | None = None) -> Any: ...


def unverified_claims(token: str) -> dict[str, Any]:
    """The payload of a JWT, not verified: only to refuse early and to know how long to cache.

    Raises:
      IdentityRefused: ``malformed``.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise IdentityRefused("malformed", "the node token is not a JWT")
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(payload)
    except (binascii.Error, ValueError) as err:
        raise IdentityRefused("malformed", f"the node token's payload does not decode: {err}") from None
    if not isinstance(claims, dict) or not isinstance(claims.get("exp"), int):
        raise IdentityRefused("malformed", "the node token's payload has no integer exp")
    return claims


class NodeVerifier:
    """Proves which node a report's agent runs on, asking the API server once per token.

    Args:
      api: lightkube's ``AsyncClient`` (or the same methods): allowed to create ``tokenreviews`` and get
        ``pods`` and ``nodes``.
      settings: whose tokens prove a node.
      clock: seconds since the epoch (token expiries are).
    """

    def __init__(self, api: KubeApi, settings: NodeIdentitySettings, clock: Callable[[], float] = time.time):
        self._api = api
        self._settings = settings
        self._clock = clock
        self._cache: dict[bytes, tuple[NodeIdentity, float]] = {}  # sha256(token) -> (identity, its exp)
        self._uids: dict[str, str] = {}  # node name -> the UID last admitted
        self._deleted: dict[str, None] = {}  # UIDs of agent pods and nodes seen deleted, oldest first

    def deleted(self, uid: str) -> None:
        """The agent pod or the node of ``uid`` was deleted (the watch saw it go): a token naming it is refused from
        now on (``pod`` or ``node``), even one verified and cached before. O(1): the cache is not walked."""
        self._deleted[uid] = None
        if len(self._deleted) > MAX_DELETED:
            del self._deleted[next(iter(self._deleted))]

    async def admit(self, token: str | None, node_id: str) -> Admission:
        """Admits a report of ``node_id`` presenting ``token``; counts each refusal by its reason.

        Raises:
          IdentityRefused: the token does not prove that its agent runs on ``node_id`` (the reason says why).
          IdentityUnavailable: the API server could not be asked.
        """
        try:
            if not token:
                raise IdentityRefused("missing", "no node token: per-node identity is on, and the agent sent none")
            identity = await self._verify(token, node_id)
        except IdentityRefused as refused:
            REFUSALS.labels(refused.reason).inc()
            raise
        previous = self._uids.get(node_id)
        self._uids[node_id] = identity.node_uid
        if previous is not None and previous != identity.node_uid:
            log.warning(
                "node %s was recreated (UID %s, was %s): its old copies are gone", node_id, identity.node_uid, previous
            )
            self._cache = {
                k: v for k, v in self._cache.items() if v[0].node_name != node_id or v[0].node_uid == identity.node_uid
            }
            return Admission(identity, replaced=True)
        return Admission(identity, replaced=False)

    async def _verify(self, token: str, node_id: str) -> NodeIdentity:
        now = self._clock()
        claims = unverified_claims(token)
        if claims["exp"] <= now:
            raise IdentityRefused("expired", f"the node token expired {now - claims['exp']:.0f} s ago")
        audiences = claims.get("aud")
        if self._settings.audience not in (audiences if isinstance(audiences, list) else [audiences]):
            raise IdentityRefused("audience", f"the node token is not for audience {self._settings.audience!r}")
        key = hashlib.sha256(token.encode()).digest()
        cached = self._cache.get(key)
        # Asked afresh only when the token's own node has since been recreated (a claim of another node is refused
        # below from the cache, without a review).
        if (
            cached is not None
            and cached[1] > now
            and self._uids.get(cached[0].node_name, cached[0].node_uid) == cached[0].node_uid
        ):
            identity = cached[0]
        else:
            identity = await self._review(token)  # a new token, or one of a node since recreated: asked afresh
            self._remember(key, identity, float(claims["exp"]), now)
        if identity.pod_uid in self._deleted:
            raise IdentityRefused(
                "pod", f"the node token's pod {identity.pod_name} (UID {identity.pod_uid}) was deleted"
            )
        if identity.node_uid in self._deleted:
            raise IdentityRefused(
                "node", f"the node token's node {identity.node_name} (UID {identity.node_uid}) was deleted"
            )
        if identity.node_name != node_id:
            raise IdentityRefused(
                "wrong_node", f"the node token is of node {identity.node_name!r}, the report speaks for {node_id!r}"
            )
        return identity

    def _remember(self, key: bytes, identity: NodeIdentity, expires: float, now: float) -> None:
        if len(self._cache) >= MAX_CACHED:
            self._cache = {k: v for k, v in self._cache.items() if v[1] > now}
            while len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]  # the oldest
        self._cache[key] = (identity, expires)

    async def _review(self, token: str) -> NodeIdentity:
        """The identity the API server vouches for, checked against the pod and the node as they are now.

        Raises:
          IdentityRefused: any check failed.
          IdentityUnavailable: the API server could not be asked.
        """
        settings = self._settings
        REVIEWS.inc()
        review = TokenReview(spec=TokenReviewSpec(token=token, audiences=[settings.audience]))
        try:
            status = (await self._api.create(review)).status
        except Exception as err:  # ApiError, or the transport's (lightkube's HTTP library is its own business)
            raise IdentityUnavailable(f"cannot review the node token with the API server: {err!r}") from None
        if status is None or not status.authenticated or status.user is None:
            raise IdentityRefused(
                "unauthenticated", f"the API server did not authenticate the node token: {status and status.error}"
            )
        if settings.audience not in (status.audiences or ()):
            raise IdentityRefused("audience", f"the node token is not for audience {settings.audience!r}")
        expected = f"system:serviceaccount:{settings.namespace}:{settings.service_account}"
        if status.user.username != expected:
            raise IdentityRefused(
                "service_account", f"the node token is {status.user.username!r}'s, not {expected!r}'s"
            )
        extra = status.user.extra or {}
        claim = {
            name: (extra.get(_EXTRA + name) or [None])[0] for name in ("node-name", "node-uid", "pod-name", "pod-uid")
        }
        if None in claim.values():
            raise IdentityRefused("no_node", "the node token names no pod and node (needs Kubernetes 1.30 or later)")
        identity = NodeIdentity(claim["node-name"], claim["node-uid"], claim["pod-name"], claim["pod-uid"])
        await self._check_pod(identity)
        node = await self._get(Node, identity.node_name, None)
        if node is None or node.metadata.uid != identity.node_uid:
            raise IdentityRefused("node", f"node {identity.node_name!r} with UID {identity.node_uid} is gone")
        return identity

    async def _check_pod(self, identity: NodeIdentity) -> None:
        settings = self._settings
        pod = await self._get(Pod, identity.pod_name, settings.namespace)
        where = f"pod {settings.namespace}/{identity.pod_name}"
        if pod is None or pod.metadata.uid != identity.pod_uid:
            raise IdentityRefused("pod", f"{where} with UID {identity.pod_uid} is gone")
        owner = next((o for o in pod.metadata.ownerReferences or () if o.controller), None)
        if owner is None or (owner.kind, owner.name) != ("DaemonSet", settings.daemonset):
            raise IdentityRefused("pod", f"{where} is not a pod of DaemonSet {settings.daemonset!r}")
        if pod.spec is None or pod.spec.nodeName != identity.node_name:
            raise IdentityRefused("pod", f"{where} does not run on node {identity.node_name!r}")

    async def _get(self, kind: Any, name: str, namespace: str | None) -> Any:
        """The object, or None when it does not exist.

        Raises:
          IdentityUnavailable: the API server could not be asked, or refused us.
        """
        try:
            return await self._api.get(kind, name, namespace=namespace)
        except ApiError as err:
            if err.status.code == 404:
                return None
            raise IdentityUnavailable(f"cannot get {kind.__name__} {name!r}: {err!r}") from None
        except Exception as err:  # the transport's (lightkube's HTTP library is its own business)
            raise IdentityUnavailable(f"cannot get {kind.__name__} {name!r}: {err!r}") from None
