"""The node agent's settings: one typed value in sections, built once from ``mtc node`` flags and passed down."""

import dataclasses
import socket
import ssl

from csi_driver.identity import DEFAULT_DRIVER_NAME
from csi_driver.volume_request import DEFAULT_MAX_NODES
from replicator.pacing import timing
from replicator.wire import tls
from replicator.wire.bearer import Tokens


@dataclasses.dataclass(frozen=True)
class CsiSettings:
    """What kubelet's side serves: the CSI plugin and the job ramdisks.

    Attributes:
      endpoint: ``unix:///path`` the CSI plugin serves on.
      driver_name: CSI driver name reported by ``GetPluginInfo``.
      ramdisk_backend: ``tmpfs`` (real, needs root) or ``dir`` (data on disk).
      default_size_bytes: ramdisk size when a volume sets none, bytes.
      retention_seconds: an idle ramdisk (no pod) is released after this long, seconds.
      max_nodes: the largest job (``nodes`` volume attribute) a publish accepts.
      kubelet_registration_dir: the kubelet's ``plugins_registry`` directory to register the driver in
        (``csi_driver.registration``), or None when a node-driver-registrar sidecar does it or no kubelet runs.
    """

    endpoint: str
    driver_name: str = DEFAULT_DRIVER_NAME
    ramdisk_backend: str = "tmpfs"
    default_size_bytes: int = 1 << 30
    retention_seconds: float = 24 * 3600
    max_nodes: int = DEFAULT_MAX_NODES
    kubelet_registration_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class PeerSettings:
    """The node's HTTP side (health, metrics, the peer service) and the peer tier.

    Attributes:
      listen: ``HOST:PORT`` of the HTTP side.
      token_file: file holding the cluster's bearer tokens (a Kubernetes Secret, one per line; ``Tokens``):
        the first is presented to peers and the coordinator, each is accepted by the peer service; read
        again when it changes. None runs without the peer tier.
      replicas: peers that hold replicas of this node's steps when data parallelism is 1 (1 or 2).
      redundancy: the jobs' redundancy unless their settings say (``replicator.wire.redundancy``).
      tls_cert, tls_key: serve the HTTP side over TLS with this certificate (PEM files), or None
        for plain HTTP.
      tls_ca: CA bundle (PEM) that peers' certificates are checked against, or None for the system's.
      tls_check: what else a peer's certificate must prove: ``NAME``, the peer's address; ``CA``,
        nothing (every agent shares one certificate that names none of them; ``tls_ca`` required).
      grants: serve peers only against the coordinator's grants (``replicator.wire.grants``), besides the token.

    Raises:
      ValueError: only one of ``tls_cert`` and ``tls_key`` is given, or ``tls_check`` is ``CA``
        without ``tls_ca``.
    """

    listen: str
    token_file: str | None = None
    replicas: int = 1
    redundancy: str = "replicas"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_check: tls.ServerCheck = tls.ServerCheck.NAME
    grants: bool = False

    def __post_init__(self):
        tls.check_pair(self.tls_cert, self.tls_key, "--peer-tls-cert and --peer-tls-key")
        if self.tls_check is tls.ServerCheck.CA and not self.tls_ca:
            raise ValueError("--peer-tls-check ca needs --peer-tls-ca")

    def client_context(self) -> ssl.SSLContext | None:
        """The context peers' certificates are checked with (``tls.client_context``), or None for the default.

        Raises:
          OSError, ssl.SSLError: ``tls_ca`` cannot be read.
        """
        return tls.client_context(self.tls_ca, self.tls_check)

    def tokens(self) -> Tokens | None:
        """The peer tokens (read again whenever the file changes); None when no file is configured.

        Raises:
          OSError: the file cannot be read.
          ValueError: the file holds no token, or a malformed one.
        """
        return Tokens(self.token_file) if self.token_file else None

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
        return f"{'https' if self.tls_cert else 'http'}://{host}:{port}"


@dataclasses.dataclass(frozen=True)
class BackupSettings:
    """The backup tier.

    Attributes:
      url: ``gs://bucket/prefix``, ``s3://bucket/prefix`` or ``file:///path``, or None for no backup tier.
      keep: complete backups kept per job.
      storage_emulator_host: a GCS emulator for ``gs://`` backups (``STORAGE_EMULATOR_HOST``), or None.
      s3_endpoint_url: an S3-compatible endpoint for ``s3://`` backups (MinIO, Ceph RGW, ...), or None
        for ``AWS_ENDPOINT_URL`` or AWS.
    """

    url: str | None = None
    keep: int = 3
    storage_emulator_host: str | None = None
    s3_endpoint_url: str | None = None


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    """The coordinator this node reports to.

    Attributes:
      url: its base URL, or None to run without it (no replicator loop).
      ca: CA bundle (PEM) its certificate is checked against, or None for the peer tier's
        (``PeerSettings.tls_ca``), then the system's.
      node_token_file: the agent's projected ServiceAccount token (the kubelet rotates it), sent with
        every report as the proof of this node (``coordinator.node_identity``); read again when it
        changes. None sends none (a coordinator without per-node identity).
    """

    url: str | None = None
    ca: str | None = None
    node_token_file: str | None = None


@dataclasses.dataclass(frozen=True)
class PacingSettings:
    """How hard and how long the agent works in the background.

    Attributes:
      background_cpu: CPUs the agent may use while it replicates and backs up (``CpuShare``), e.g.
        0.5; None for no cap.
      restore_deadline_seconds: a restore gives up (and tells the job) after this long, seconds;
        keep it below Orbax's 300 s wait for the marker.
      wedged_after_seconds: a replicator loop without a completed pass for this long makes the
        agent unhealthy (its livenessprobe restarts it), seconds.
      min_push_interval_seconds: at most one push per job and peer this often, seconds: a job saving
        faster replicates one step per round (``coordinator/copies/replicas.py``).
    """

    background_cpu: float | None = None
    restore_deadline_seconds: float = timing.RESTORE_DEADLINE_SECONDS
    wedged_after_seconds: float = timing.WEDGED_AFTER_SECONDS
    min_push_interval_seconds: float = timing.MIN_PUSH_INTERVAL_SECONDS


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Settings of one node agent, built once from ``mtc node`` flags.

    Attributes:
      node_id: this node's name (Kubernetes node name).
      root: data directory; job tmpfs mounts live below it.
      csi, peer, backup, coordinator, pacing: the sections above.
      topology: topology labels, e.g. ``{"topology.kubernetes.io/zone": "a"}``.
      pod_address: the address pods on this node are reachable at, or None for JobSet DNS.
    """

    node_id: str
    root: str
    csi: CsiSettings
    peer: PeerSettings
    backup: BackupSettings = BackupSettings()
    coordinator: CoordinatorSettings = CoordinatorSettings()
    pacing: PacingSettings = PacingSettings()
    topology: dict[str, str] = dataclasses.field(default_factory=dict)
    pod_address: str | None = None

    @property
    def coordinator_ca(self) -> str | None:
        """The CA bundle the coordinator's certificate is checked against, or None for the system's."""
        return self.coordinator.ca or self.peer.tls_ca
