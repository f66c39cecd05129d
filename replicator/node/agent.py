"""The node agent (``mtc node``): the composition of one node's process.

It builds the CSI plugin (``csi_driver``: ramdisk manager, servicers, gRPC server) with the
framework protocol's publish hook, the replicator, the peer service and the backup store, and runs
them: gRPC serves kubelet from its own thread pool; the asyncio loop runs the HTTP side (health,
metrics, peer routes), the replicator and the idle-ramdisk reaper.
"""

import asyncio
import contextlib
import logging
import shutil
import signal
import threading

import psutil
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from csi_driver.identity import IdentityServicer
from csi_driver.node import NodeServicer
from csi_driver.ramdisk import Ramdisk, RamdiskManager, make_backend
from csi_driver.registration import RegistrationServer, RegistrationServicer
from csi_driver.server import start_csi_server
from csi_driver.volume_request import VolumeLimits, VolumeSpec
from prefetch import stagers
from prefetch.restore import Restorer
from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.store import BackupStore
from replicator.backup_tier.worker import BackupWorker
from replicator.local_tier import frameworks
from replicator.local_tier.job_keys import BusySteps
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.log_once import LogOnce
from replicator.node.commit_detection import CommitDetector
from replicator.node.config import CsiSettings, NodeConfig
from replicator.node.job_series import JobSeries
from replicator.node.loop import NodeParts, NodeReplicator
from replicator.node.notices import NodeNotices
from replicator.node.pushes import Pusher
from replicator.node.report_session import ReportSession
from replicator.node.room import RoomKeeper
from replicator.node.store_check import StoreCheck
from replicator.pacing import timing
from replicator.pacing.cpu_share import CpuShare
from replicator.parity.encoder import Encoder
from replicator.peer_tier.grant_check import PeerGrants
from replicator.peer_tier.service import add_peer_routes
from replicator.wire import tls
from replicator.wire.bearer import Tokens
from replicator.wire.grants import GrantKeys
from replicator.wire.metric_labels import JOB_LABELS

log = logging.getLogger(__name__)

RAMDISK_BYTES = Gauge("mtc_ramdisk_size_bytes", "Size limit of each job ramdisk on this node", JOB_LABELS)
# The dir backend has no size of its own: there it is the use of the file system holding it.
RAMDISK_USED = Gauge("mtc_ramdisk_used_bytes", "Bytes in use in each job ramdisk on this node", JOB_LABELS)


def on_new_pod(disk: Ramdisk, spec: VolumeSpec) -> None:
    """The publish hook: records the framework the pod asks for (``spec.framework``, one the
    ``VolumeLimits`` accept) on its ramdisk, and clears the previous pod's protocol files with it."""
    framework = frameworks.get(spec.framework)
    framework.clear_previous_pod(disk.client_dir)
    JobMeta(disk.path).record_framework(framework)


def open_ramdisks(root: str, backend: str, series: JobSeries | None = None) -> RamdiskManager:
    """The node's ramdisk manager (``--root``, ``--ramdisk-backend`` ``tmpfs`` or ``dir``), with the
    framework protocol's cleanup as its publish hook: a new pod never reads the previous pod's rank.
    With ``series``, the hook also creates the job's metric series.

    Raises:
      ValueError: an unknown backend.
    """

    def published(disk: Ramdisk, spec: VolumeSpec) -> None:
        on_new_pod(disk, spec)
        if series is not None:
            series.seed(disk.namespace, disk.job)

    return RamdiskManager(root, make_backend(backend), on_new_pod=published)


def build_replicator(
    config: NodeConfig,
    coordinator_url: str,
    manager: RamdiskManager,
    peer_token: Tokens | None = None,
    backup_store: BackupStore | None = None,
    share: CpuShare | None = None,
    grant_keys: GrantKeys | None = None,
    notices: NodeNotices | None = None,
) -> NodeReplicator:
    """The replicator loop with its collaborators (``NodeParts``).

    Args:
      coordinator_url: the coordinator's URL (``config.coordinator.url``).
      backup_store: the backup tier, or None to run without it.
      share: the CPU cap of replication and backup while jobs train, or None (restores never pace).
      notices: the node's notices, sent with its reports (``notices``).
      others: as ``NodeReplicator``.
    """
    busy_steps, log_once = BusySteps(), LogOnce()  # busy: being read by a push or an upload: GC keeps them
    reporting = ReportSession(
        config.node_id,
        config.peer.url,
        config.pod_address,
        config.topology,
        config.peer.replicas,
        backup_store is not None,
        config.peer.redundancy,
        notices,
    )
    room = RoomKeeper(busy_steps, log_once, config.peer.replicas if peer_token is not None else 0, reporting.notices)

    def error_to_job(meta: JobMeta, message: str) -> None:
        log_once(f"job-error-{meta.root}", message, meta)

    backup = (
        BackupWorker(backup_store, config.backup.keep, busy_steps, error_to_job, reporting.poke, share)
        if backup_store
        else None
    )
    restorer = Restorer(
        stagers.for_node(config.node_id, peer_token, config.peer.client_context(), backup.download if backup else None),
        log_once,
        config.pacing.restore_deadline_seconds,
        room.make_room,
        busy_steps=busy_steps,
    )
    pushes, encodes = _peer_parts(config, peer_token, share, busy_steps, log_once)
    parts = NodeParts(
        reporting, room, restorer, CommitDetector(share, reporting.poke), busy_steps, log_once, backup, pushes, encodes
    )
    return NodeReplicator(config, coordinator_url, manager, parts, peer_token, grant_keys)


def _register(csi: CsiSettings) -> RegistrationServer | None:
    """Registers the driver with the kubelet (its plugin registration dir), or None without one."""
    if not csi.kubelet_registration_dir:
        return None
    return RegistrationServer(csi.kubelet_registration_dir, RegistrationServicer(csi.driver_name, csi.endpoint)).start()


def _peer_parts(
    config: NodeConfig, peer_token: Tokens | None, share: CpuShare | None, busy_steps: BusySteps, log_once: LogOnce
) -> tuple[Pusher | None, Encoder | None]:
    """The pushes of replicas and the parity encodes, both over the peer tier: None without a peer token."""
    if peer_token is None:
        return None, None
    pusher = Pusher(peer_token, share, busy_steps, log_once, config.pacing.min_push_interval_seconds)
    return pusher, Encoder(peer_token, share, log_once, peer_ssl=config.peer.client_context())


class NodeAgent:
    """Owns the ramdisk manager and the servers of one node."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.ready = threading.Event()
        self.series = JobSeries()
        self.manager = open_ramdisks(config.root, config.csi.ramdisk_backend, self.series)
        self.peer_token = config.peer.tokens()
        if self.peer_token is None:
            log.warning("no --peer-token-file: the peer tier (replication, restore from peers) is off")
        backup = config.backup
        store = (
            open_backup_store(
                backup.url, emulator_host=backup.storage_emulator_host, s3_endpoint_url=backup.s3_endpoint_url
            )
            if backup.url
            else None
        )
        # What the operator sees as Warning events: sent with the reports, so nowhere without a coordinator.
        self.notices = NodeNotices()
        self.store, self.store_check = store, StoreCheck(store.url if store else None, notices=self.notices)
        self.share = CpuShare(config.pacing.background_cpu) if config.pacing.background_cpu else None
        # With --peer-grants: the coordinator's keys, learnt by the report loop, checked by the peer service.
        self.grants = PeerGrants(GrantKeys(), config.node_id) if config.peer.grants else None
        self.replicator = (
            build_replicator(
                config,
                config.coordinator.url,
                self.manager,
                self.peer_token,
                store,
                self.share,
                self.grants.keys if self.grants else None,
                self.notices,
            )
            if config.coordinator.url
            else None
        )

    def _ramdisk_path(self, namespace: str, job: str) -> str | None:
        disk = self.manager.ramdisks().get((namespace, job))
        return disk.path if disk else None

    def _make_room(self, namespace: str, job: str, need: int, step: int) -> None:
        """Gives up unsafe copies of the job's ramdisk, but of ``step``, for a replica of ``step`` it
        receives (``NodeReplicator.make_room``)."""
        disk = self.manager.ramdisks().get((namespace, job))
        if disk is not None and self.replicator is not None:
            self.replicator.make_room(disk, need, keep=step)

    def healthy(self) -> bool:
        """Recovered and serving, and no replicator loop is wedged."""
        return self.ready.is_set() and (self.replicator is None or self.replicator.healthy())

    def _make_http_app(self) -> web.Application:
        async def healthz(request: web.Request) -> web.Response:
            healthy = self.healthy()
            # The store's state is shown, not judged: a store fault must not restart agents (store_check.py).
            body = {
                "node": self.config.node_id,
                "ready": healthy,
                "backup_store": self.store_check.summary(),
                # The coordinator keys it checks peer grants with (mtc doctor), null without --peer-grants.
                "grant_keys": self.grants.keys.key_ids if self.grants else None,
            }
            return web.json_response(body, status=200 if healthy else 503)

        async def metrics(request: web.Request) -> web.Response:
            RAMDISK_BYTES.clear()
            RAMDISK_USED.clear()
            ramdisks = self.manager.ramdisks()
            self.series.keep_only(set(ramdisks))
            for (namespace, job), disk in ramdisks.items():
                RAMDISK_BYTES.labels(namespace, job).set(disk.size_bytes)
                with contextlib.suppress(OSError):  # released between listing and statvfs
                    usage = shutil.disk_usage(disk.path)
                    RAMDISK_USED.labels(namespace, job).set(usage.total - usage.free)
            return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.add_routes([web.get("/healthz", healthz), web.get("/metrics", metrics)])
        if self.peer_token is not None:
            add_peer_routes(app, self._ramdisk_path, self.peer_token, self.share, self._make_room, self.grants)
        return app

    async def run(self, stop: asyncio.Event) -> None:
        """Serves until ``stop`` is set."""
        csi = self.config.csi
        identity = IdentityServicer(csi.driver_name, self.healthy)
        poke = (lambda *_: self.replicator.poke()) if self.replicator else (lambda *_: None)  # type: ignore[union-attr]  # made once, not reset
        node = NodeServicer(
            self.manager,
            self.config.node_id,
            self.config.topology,
            csi.default_size_bytes,
            VolumeLimits(csi.max_nodes, psutil.virtual_memory().total, frozenset(frameworks.REGISTRY)),
            poke,
            poke,
            self.notices.refused,
        )
        # Recovery first: kubelet must never be served from a state file the mount table contradicts.
        survivors = await asyncio.to_thread(self.manager.recover)
        log.info("recovered %d ramdisk(s): %s", len(survivors), [f"{d.namespace}/{d.job}" for d in survivors])
        csi_server = start_csi_server(csi.endpoint, identity, node)
        registration = _register(csi)  # after the CSI socket serves: registering, the kubelet calls NodeGetInfo on it
        runner = web.AppRunner(self._make_http_app())
        await runner.setup()
        try:
            await web.TCPSite(
                runner,
                *self.config.peer.host_port,
                ssl_context=tls.server_context(self.config.peer.tls_cert, self.config.peer.tls_key),
            ).start()
            self.ready.set()
            log.info("node agent %s ready (HTTP on %s)", self.config.node_id, self.config.peer.listen)
            replicating = asyncio.create_task(self.replicator.run(stop)) if self.replicator else None
            checking = (
                asyncio.create_task(self.store_check.run(self.store.objects, self.config.node_id, stop))
                if self.store
                else None
            )
            while not stop.is_set():
                released = await asyncio.to_thread(self.manager.reap_idle, csi.retention_seconds)
                for key in released:
                    log.info("released idle ramdisk %s/%s after %.0f s retention", *key, csi.retention_seconds)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timing.REAP_INTERVAL_SECONDS)
            if replicating:
                await replicating
            if checking:
                checking.cancel()  # a probe in flight is of no use once the agent stops
                with contextlib.suppress(asyncio.CancelledError):
                    await checking
        finally:
            self.ready.clear()
            if registration:
                registration.stop()
            csi_server.stop(grace=timing.CSI_STOP_GRACE_SECONDS).wait()
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
