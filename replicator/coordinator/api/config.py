"""The settings of ``mtc coordinator``, built once by the CLI and passed to the app."""

import dataclasses
import ssl

from replicator.coordinator.kube.kube_config import KubeSettings
from replicator.coordinator.trust.node_identity import NodeIdentitySettings
from replicator.wire import tls
from replicator.wire.messages import MAX_RANKS


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of ``mtc coordinator``.

    Attributes:
      listen: ``HOST:PORT``.
      state_dir: where a snapshot of job settings is kept to warm a restart, or None. Only an
        accelerator: node reports rebuild everything.
      node_timeout_seconds: a node silent this long is silent: no orders to it, its copies not counted
        as safe; its pods stay in their incarnation until unpublished or replaced, seconds.
      holder_grace_seconds: a silent node's copies stay restore sources (waited for) this long, seconds; a node
        outside the restoring incarnation only while no step can be restored without it (``restores.plan``).
      token_file: the cluster's shared tokens (the peer token's Secret, one per line, read again when it
        changes): every route that changes state or hands out a restore plan requires one of them. Status, health and metrics stay open. None
        runs open (``--insecure``), with a warning.
      tls_cert, tls_key: serve HTTPS with this certificate (PEM files), or None for plain HTTP.
      max_nodes: the largest job a report may describe (a pod's ``nodes``).
      kube: read job shapes, ranks, rank 0's address and failure domains from the API server, or None to take
        them from the volumes' attributes alone.
      node_identity: with ``kube``, every report must carry a token proving that its agent runs on the
        report's node (``node_identity``), or None to trust the cluster token alone.
      operator_identity: with ``kube``, the operators' routes (``restore-from``, status) take the caller's own
        Kubernetes token, checked with a TokenReview and RBAC (``operator_auth``); False: the rollback and its
        cancel take the cluster token, status and the preview stay open.
      peer_grants: sign a grant into every replica push and restore source (``replicator.wire.grants``), and
        send the key in every report reply; agents with ``--peer-grants`` serve peers only against them.
      restore_fan_out: a restore from the backup tier alone reads each unique shard once per group
        of identical data-parallel ranks; the others fetch it from that node (``ClusterState``).
      shared_backup_upload: identical data-parallel ranks share a backup's upload (``ClusterState``).
    """

    listen: str
    state_dir: str | None = None
    node_timeout_seconds: float = 15.0
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_nodes: int = MAX_RANKS
    holder_grace_seconds: float = 60.0
    kube: KubeSettings | None = None
    restore_fan_out: bool = True
    shared_backup_upload: bool = False
    node_identity: NodeIdentitySettings | None = None
    peer_grants: bool = False
    operator_identity: bool = False

    def __post_init__(self) -> None:
        if self.node_identity is not None and self.kube is None:
            raise ValueError("per-node identity needs the API server (kube settings)")
        if self.operator_identity and self.kube is None:
            raise ValueError("operator identity needs the API server (kube settings)")

    def server_ssl(self) -> ssl.SSLContext | None:
        """The TLS context to serve with, or None for plain HTTP.

        Raises:
          OSError, ssl.SSLError: the certificate or key cannot be loaded.
        """
        return tls.server_context(self.tls_cert, self.tls_key)
