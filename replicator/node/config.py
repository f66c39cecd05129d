"""The node agent's settings: one typed value, built once from ``mtc node`` flags and passed down."""

import dataclasses
import socket
import ssl

from csi_driver.volume_request import DEFAULT_MAX_NODES
from replicator.pacing import timing
from replicator.wire.bearer import read_token


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Settings of one node agent, built once from ``mtc node`` flags.

    Attributes:
      node_id: this node's name (Kubernetes node name).
      root: data directory; job tmpfs mounts live below it.
      csi_endpoint: ``unix:///path`` the CSI plugin serves on.
      listen: ``HOST:PORT`` of the HTTP side.
      driver_name: CSI driver name reported by ``GetPluginInfo``.
      ramdisk_backend: ``tmpfs`` (real, needs root) or ``dir`` (data on disk).
      default_size_bytes: ramdisk size when a volume sets none, bytes.
      retention_seconds: an idle ramdisk (no pod) is released after this long, seconds.
      topology: topology labels, e.g. ``{"topology.kubernetes.io/zone": "a"}``.
      coordinator: the coordinator's base URL, or None.
      backup: the backup tier URL (``gs://bucket/prefix``, ``s3://bucket/prefix`` or ``file:///path``), or None.
      pod_address: the address pods on this node are reachable at, or None for JobSet DNS.
      peer_token_file: file holding the cluster's bearer token (a Kubernetes Secret): required by
        the peer service and presented to peers and the coordinator; None runs without the peer tier.
      replicas: peers that hold replicas of this node's steps when data parallelism is 1 (1 or 2).
      peer_tls_cert, peer_tls_key: serve the HTTP side over TLS with this certificate (PEM files),
        or None for plain HTTP.
      peer_tls_ca: CA bundle (PEM) that peers' certificates are checked against, or None for the
        system's.
      backup_keep: complete backups kept per job.
      max_nodes: the largest job (``nodes`` volume attribute) a publish accepts.
      coordinator_ca: CA bundle (PEM) the coordinator's certificate is checked against, or None for
        ``peer_tls_ca`` (then the system's).
      storage_emulator_host: a GCS emulator for ``gs://`` backups (``STORAGE_EMULATOR_HOST``), or None.
      s3_endpoint_url: an S3-compatible endpoint for ``s3://`` backups (MinIO, Ceph RGW, ...), or None
        for ``AWS_ENDPOINT_URL`` or AWS.
      background_cpu: CPUs the agent may use while it replicates and backs up (``CpuShare``), e.g.
        0.5; None for no cap.
      restore_deadline_seconds: a restore gives up (and tells the job) after this long, seconds;
        keep it below Orbax's 300 s wait for the marker.
      wedged_after_seconds: a replicator loop without a completed pass for this long makes the
        agent unhealthy (its livenessprobe restarts it), seconds.
      min_push_interval_seconds: at most one push per job and peer this often, seconds: a job saving
        faster replicates only its newest step.
    """

    node_id: str
    root: str
    csi_endpoint: str
    listen: str
    driver_name: str
    ramdisk_backend: str = "tmpfs"
    default_size_bytes: int = 1 << 30
    retention_seconds: float = 24 * 3600
    topology: dict[str, str] = dataclasses.field(default_factory=dict)
    coordinator: str | None = None
    backup: str | None = None
    pod_address: str | None = None
    peer_token_file: str | None = None
    replicas: int = 1
    peer_tls_cert: str | None = None
    peer_tls_key: str | None = None
    peer_tls_ca: str | None = None
    backup_keep: int = 3
    max_nodes: int = DEFAULT_MAX_NODES
    coordinator_ca: str | None = None
    storage_emulator_host: str | None = None
    s3_endpoint_url: str | None = None
    background_cpu: float | None = None
    restore_deadline_seconds: float = timing.RESTORE_DEADLINE_SECONDS
    wedged_after_seconds: float = timing.WEDGED_AFTER_SECONDS
    min_push_interval_seconds: float = timing.MIN_PUSH_INTERVAL_SECONDS

    def server_ssl(self) -> ssl.SSLContext | None:
        """The TLS context of the HTTP side, or None for plain HTTP.

        Raises:
          ValueError: only one of certificate and key is given.
          OSError, ssl.SSLError: they cannot be loaded.
        """
        if (self.peer_tls_cert is None) != (self.peer_tls_key is None):
            raise ValueError("--peer-tls-cert and --peer-tls-key go together")
        if self.peer_tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.peer_tls_cert, self.peer_tls_key)
        return context

    def client_ssl(self) -> ssl.SSLContext | None:
        """The TLS context for calls to peers, or None for aiohttp's default."""
        return ssl.create_default_context(cafile=self.peer_tls_ca) if self.peer_tls_ca else None

    def coordinator_ssl(self) -> ssl.SSLContext | None:
        """The TLS context for calls to the coordinator, or None for aiohttp's default."""
        cafile = self.coordinator_ca or self.peer_tls_ca
        return ssl.create_default_context(cafile=cafile) if cafile else None

    def peer_token(self) -> str | None:
        """Reads the peer token; None when no file is configured.

        Raises:
          OSError: the file cannot be read.
          ValueError: the file is empty.
        """
        return read_token(self.peer_token_file) if self.peer_token_file else None

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host, int(port)

    @property
    def url(self) -> str:
        """The HTTP base URL peers and the coordinator reach this agent at."""
        host, port = self.host_port
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return f"{'https' if self.peer_tls_cert else 'http'}://{host}:{port}"
