"""The node agent (``mtc node``): the composition of one node's process.

It builds the CSI plugin (``csi_driver``: ramdisk manager, servicers, gRPC server) with the
framework protocol's publish hook, the replicator, the peer service and the backup store, and runs
them: gRPC serves kubelet from its own thread pool; the asyncio loop runs the HTTP side (health,
metrics, peer routes), the replicator and the idle-ramdisk reaper.
"""

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import signal
import socket
import ssl
import threading

import psutil
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from csi_driver.identity import IdentityServicer
from csi_driver.node import NodeServicer
from csi_driver.ramdisk import RamdiskManager, make_backend
from csi_driver.server import start_csi_server
from csi_driver.volume_request import DEFAULT_MAX_NODES, VolumeLimits
from replicator.backup_backends import open_backup_store
from replicator.bearer import read_token
from replicator.cpu_share import CpuShare
from replicator.node_replicator import NodeReplicator
from replicator.orbax_protocol import clear_previous_pod
from replicator.peer_service import add_peer_routes

log = logging.getLogger(__name__)

RAMDISK_BYTES = Gauge("mtc_ramdisk_size_bytes", "Size limit of each job ramdisk on this node", ["namespace", "job"])
# The dir backend has no size of its own: there it is the use of the file system holding it.
RAMDISK_USED = Gauge("mtc_ramdisk_used_bytes", "Bytes in use in each job ramdisk on this node", ["namespace", "job"])


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


_REAP_INTERVAL_SECONDS = 30.0


def open_ramdisks(root: str, backend: str) -> RamdiskManager:
    """The node's ramdisk manager (``--root``, ``--ramdisk-backend`` ``tmpfs`` or ``dir``), with the
    Orbax protocol's cleanup as its publish hook: a new pod never reads the previous pod's rank.

    Raises:
      ValueError: an unknown backend.
    """
    return RamdiskManager(root, make_backend(backend), on_new_pod=clear_previous_pod)


class NodeAgent:
    """Owns the ramdisk manager and the servers of one node."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.ready = threading.Event()
        self.manager = open_ramdisks(config.root, config.ramdisk_backend)
        self.peer_token = config.peer_token()
        if self.peer_token is None:
            log.warning("no --peer-token-file: the peer tier (replication, restore from peers) is off")
        store = (open_backup_store(config.backup, emulator_host=config.storage_emulator_host,
                                   s3_endpoint_url=config.s3_endpoint_url) if config.backup else None)  # fmt: skip
        self.share = CpuShare(config.background_cpu) if config.background_cpu else None
        self.replicator = (
            NodeReplicator(config.node_id, config.url, config.pod_address, config.topology, self.manager,
                           config.coordinator, self.peer_token, config.replicas, store, config.backup_keep,
                           config.client_ssl(), config.coordinator_ssl(), share=self.share)  # fmt: skip
            if config.coordinator
            else None
        )

    def _ramdisk_path(self, namespace: str, job: str) -> str | None:
        disk = self.manager.ramdisks().get((namespace, job))
        return disk.path if disk else None

    def healthy(self) -> bool:
        """Recovered and serving, and no replicator loop is wedged."""
        return self.ready.is_set() and (self.replicator is None or self.replicator.healthy())

    def _make_http_app(self) -> web.Application:
        async def healthz(request: web.Request) -> web.Response:
            healthy = self.healthy()
            return web.json_response({"node": self.config.node_id, "ready": healthy}, status=200 if healthy else 503)

        async def metrics(request: web.Request) -> web.Response:
            RAMDISK_BYTES.clear()
            RAMDISK_USED.clear()
            for (namespace, job), disk in self.manager.ramdisks().items():
                RAMDISK_BYTES.labels(namespace, job).set(disk.size_bytes)
                with contextlib.suppress(OSError):  # released between listing and statvfs
                    usage = shutil.disk_usage(disk.path)
                    RAMDISK_USED.labels(namespace, job).set(usage.total - usage.free)
            return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.add_routes([web.get("/healthz", healthz), web.get("/metrics", metrics)])
        if self.peer_token is not None:
            add_peer_routes(app, self._ramdisk_path, self.peer_token, self.share)
        return app

    async def run(self, stop: asyncio.Event) -> None:
        """Serves until ``stop`` is set."""
        identity = IdentityServicer(self.config.driver_name, self.healthy)
        poke = (lambda *_: self.replicator.poke()) if self.replicator else (lambda *_: None)
        node = NodeServicer(
            self.manager, self.config.node_id, self.config.topology, self.config.default_size_bytes,
            VolumeLimits(self.config.max_nodes, psutil.virtual_memory().total), poke, poke,
        )
        # Recovery first: kubelet must never be served from a state file the mount table contradicts.
        survivors = await asyncio.to_thread(self.manager.recover)
        log.info("recovered %d ramdisk(s): %s", len(survivors), [f"{d.namespace}/{d.job}" for d in survivors])
        csi_server = start_csi_server(self.config.csi_endpoint, identity, node)
        runner = web.AppRunner(self._make_http_app())
        await runner.setup()
        try:
            await web.TCPSite(runner, *self.config.host_port, ssl_context=self.config.server_ssl()).start()
            self.ready.set()
            log.info("node agent %s ready (HTTP on %s)", self.config.node_id, self.config.listen)
            replicating = asyncio.create_task(self.replicator.run(stop)) if self.replicator else None
            while not stop.is_set():
                released = await asyncio.to_thread(self.manager.reap_idle, self.config.retention_seconds)
                for key in released:
                    log.info("released idle ramdisk %s/%s after %.0f s retention", *key, self.config.retention_seconds)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), _REAP_INTERVAL_SECONDS)
            if replicating:
                await replicating
        finally:
            self.ready.clear()
            csi_server.stop(grace=5).wait()
            await runner.cleanup()


def run_node(config: NodeConfig) -> None:
    """Runs the agent in the foreground until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await NodeAgent(config).run(stop)

    asyncio.run(main())
