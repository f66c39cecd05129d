"""Peer grants: the coordinator's signed, short-lived permission for one node to fetch or push one copy.

With per-node identity (``mtc coordinator --node-identity --peer-grants``) the coordinator knows which node each
report comes from, so it can say who may read or write which copy on which node. Each ``ReplicateOrder`` target and
each ``RestoreView`` source carries a grant naming the operation, the job, the rank and step, the node that asks
(``from``) and the node that serves (``to``), and an expiry. The serving agent (``mtc node --peer-grants``)
checks it before anything else of the request: a grant for job J fetches nothing of job K, cannot be replayed to
another node, and expires. The agents learn the coordinator's public key from its report replies, over the TLS
connection they already check against the coordinator's CA; no agent needs API access. A holder of the shared
cluster token alone can then no longer read or offer another job's data on a peer.

A grant is ``<claims>.<signature>``: base64url (unpadded) of the claims' JSON and of their Ed25519 signature
(RFC 8032, through ``cryptography``). Keys are made at the coordinator's start; agents keep the last two they
were told of, so grants issued just before a coordinator restart stay good until they expire.
"""

import base64
import binascii
import hashlib
import threading
import time
from typing import Annotated, Literal

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from replicator.wire.messages import Name, Rank, Step

GRANT_HEADER = "X-MTC-Grant"
# How long a grant is good for, seconds: a replica push or a restore's fetch of one step must finish within it
# (each request is checked); the coordinator issues fresh ones with every reply and view.
GRANT_SECONDS = 900.0
# Clocks of the coordinator's and the serving agent's nodes may differ by this much, seconds.
CLOCK_SKEW_SECONDS = 30.0
_MAX_GRANT_CHARS = 2_048
_KEPT_KEYS = 2

Operation = Literal["fetch", "push", "parity"]


class PeerGrant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The claims of a grant.

    Attributes:
      op: ``fetch`` (GET the step's manifest and files), ``push`` (PUT its files and commit a replica) or
        ``parity`` (GET a parity shard of the group whose first member is ``rank``).
      namespace, job, rank, step: the one copy it covers.
      frm: the node that asks (for the serving agent's log; it cannot prove who asks).
      to: the node that serves: the only one that accepts it.
      exp: when it expires, Unix seconds.
      kid: which coordinator key signed it (``key_id``).
    """

    op: Operation
    namespace: Name
    job: Name
    rank: Rank
    step: Step
    frm: Name
    to: Name
    exp: float
    kid: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]


class GrantRefused(Exception):
    """A request's grant does not allow it. ``reason`` is a short label (a metric label, the JSON ``reason``)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_id(public_key: bytes) -> str:
    """The id of a raw 32-byte Ed25519 public key: the first 8 bytes of its SHA-256, in hex."""
    return hashlib.sha256(public_key).hexdigest()[:16]


class GrantSigner:
    """The coordinator's side: one Ed25519 key, made at start (or given), and the grants it signs."""

    def __init__(self, private_key: Ed25519PrivateKey | None = None):
        self._key = private_key or Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key = _b64(raw)
        """The raw public key, base64url: what report replies carry (``ReportReply.grant_key``)."""
        self.key_id = key_id(raw)

    def issue(
        self,
        op: Operation,
        namespace: str,
        job: str,
        rank: int,
        step: int,
        frm: str,
        to: str,
        now: float | None = None,
        seconds: float = GRANT_SECONDS,
    ) -> str:
        """A grant for ``frm`` to ``op`` rank ``rank``'s step ``step`` of the job on node ``to``, good for
        ``seconds`` from ``now`` (Unix seconds; the current time by default)."""
        claims = msgspec.json.encode(
            PeerGrant(
                op, namespace, job, rank, step, frm, to, (time.time() if now is None else now) + seconds, self.key_id
            )
        )
        return f"{_b64(claims)}.{_b64(self._key.sign(claims))}"


class GrantKeys:
    """The agent's side: the coordinator keys it was told of (the last two), and the check of a grant.

    Thread-safe: the report loop learns keys while the peer service checks grants.
    """

    def __init__(self) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._lock = threading.Lock()

    @property
    def known(self) -> bool:
        """Whether any key has been learnt (before the first reply, every grant is refused)."""
        return bool(self._keys)

    @property
    def key_ids(self) -> list[str]:
        """The ids (``key_id``) of the keys kept, oldest first: what ``/healthz`` shows for ``mtc doctor``."""
        with self._lock:
            return list(self._keys)

    def learn(self, public_key: str) -> None:
        """Keeps ``public_key`` (``GrantSigner.public_key``) as the newest; the oldest beyond two is dropped.

        Raises:
          ValueError: it is not a base64url Ed25519 public key.
        """
        try:
            raw = _unb64(public_key)
            key = Ed25519PublicKey.from_public_bytes(raw)
        except (ValueError, binascii.Error) as err:
            raise ValueError(f"the coordinator's grant key is not a base64url Ed25519 public key: {err}") from None
        kid = key_id(raw)
        with self._lock:
            if kid in self._keys:
                return
            self._keys[kid] = key
            while len(self._keys) > _KEPT_KEYS:
                del self._keys[next(iter(self._keys))]

    def check(
        self,
        grant: str,
        *,
        allowed: tuple[Operation, ...],
        namespace: str,
        job: str,
        rank: int,
        step: int,
        node: str,
        now: float | None = None,
    ) -> PeerGrant:
        """The claims of ``grant`` if it is one of the ``allowed`` operations on this copy at node ``node`` at ``now``
        (a push's grant also reads the manifest back: the pusher asks whether the target still holds the copy).

        Raises:
          GrantRefused: ``missing``, ``malformed``, ``unknown key``, ``bad signature``, ``expired``, ``other node``,
            ``other operation`` or ``other copy`` (another job, rank or step), with a detail for the caller.
        """
        if not grant:
            raise GrantRefused("missing", f"this node serves peers only with a coordinator's grant ({GRANT_HEADER})")
        if len(grant) > _MAX_GRANT_CHARS or grant.count(".") != 1:
            raise GrantRefused("malformed", "a grant is <claims>.<signature>, base64url")
        encoded, signature = grant.split(".")
        try:
            claims_bytes, signature_bytes = _unb64(encoded), _unb64(signature)
            claims = msgspec.json.decode(claims_bytes, type=PeerGrant)
        except (ValueError, binascii.Error, msgspec.DecodeError) as err:
            raise GrantRefused("malformed", f"the grant cannot be read: {err}") from None
        with self._lock:
            key = self._keys.get(claims.kid)
        if key is None:
            raise GrantRefused("unknown key", f"key {claims.kid} is not the coordinator's (or no longer)")
        try:
            key.verify(signature_bytes, claims_bytes)
        except InvalidSignature:
            raise GrantRefused("bad signature", "the grant was not signed by the coordinator's key") from None
        if (time.time() if now is None else now) > claims.exp + CLOCK_SKEW_SECONDS:
            raise GrantRefused("expired", f"the grant expired at {claims.exp:.0f} (Unix seconds)")
        if claims.to != node:
            raise GrantRefused("other node", f"the grant is for node {claims.to}, this is {node}")
        if claims.op not in allowed:
            raise GrantRefused("other operation", f"the grant allows {claims.op}, not {' or '.join(allowed)}")
        if (claims.namespace, claims.job, claims.rank, claims.step) != (namespace, job, rank, step):
            raise GrantRefused(
                "other copy",
                f"the grant covers {claims.namespace}/{claims.job} rank {claims.rank} step {claims.step}, "
                f"not {namespace}/{job} rank {rank} step {step}",
            )
        return claims
