"""The node agent's replicator loop, for every job ramdisk on the node: it drives the concerns below, which the
agent builds (``agent.build_replicator``, ``NodeParts``).

- Reports the node's pods and committed steps to the coordinator: at once on a change, else as a
  heartbeat at the pace the coordinator sets (``ReportSession``; ``CoordinatorClient``), and hands
  the reply's orders on: replicate (``pushes``), retain (``garbage_collection``), back up
  (``BackupWorker``).
- Runs one worker per published job: the pod's hand-shake files (``pod_handshake``), its restore
  (``prefetch.restore``), then commit detection (``commit_detection``) and room for the next save (``room``).
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping

import aiohttp
from prometheus_client import Counter, Gauge, Histogram

from csi_driver.ramdisk import Ramdisk, RamdiskManager
from prefetch.restore import Restorer
from replicator.backup_tier.worker import BackupWorker
from replicator.local_tier import steps
from replicator.local_tier.job_keys import BusySteps, by_job
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.log_once import LogOnce
from replicator.local_tier.parity_shards import ParityShards
from replicator.local_tier.steps import drop_abandoned
from replicator.node import handshake
from replicator.node.commit_detection import CommitDetector
from replicator.node.config import NodeConfig
from replicator.node.garbage_collection import collect_garbage
from replicator.node.pushes import Pusher
from replicator.node.report_session import HeldCopy, OwnStep, ReportSession
from replicator.node.room import RoomKeeper
from replicator.pacing import timing
from replicator.parity.encoder import Encoder
from replicator.wire import tls
from replicator.wire.bearer import Tokens
from replicator.wire.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from replicator.wire.grants import GrantKeys
from replicator.wire.messages import Assignment, HeldShard, JobRef, Lineage, NodeReport, PodReport, files_digest

log = logging.getLogger(__name__)

LOOP_ERRORS = Counter(
    "mtc_replicator_loop_errors_total", "Errors caught in the replicator's loops, which carried on", ["loop"]
)
REPORT_SECONDS = Histogram("mtc_coordinator_report_seconds", "Round trip of one report to the coordinator, seconds")
LAST_REPORT = Gauge(
    "mtc_coordinator_last_report_timestamp_seconds", "Unix time of the last report the coordinator answered"
)
# Known label values start at zero, so dashboards and alerts see the series before the first event.
for _label in ("report", "job"):
    LOOP_ERRORS.labels(_label)

_ROUND = "report-round"


@dataclasses.dataclass(frozen=True)
class NodeParts:
    """The replicator loop's collaborators, built by the agent (``agent.build_replicator``).

    Attributes:
      reporting: what the coordinator acknowledged, the heartbeat's pace and the wake-up of the loop.
      room: room on the job ramdisks, by the latest retain orders.
      restorer: the pods' restores.
      commits: commit detection.
      busy_steps: steps being read by a push, an upload or a restore: garbage collection keeps them.
      log_once: the agent's throttled error log.
      backup: the backup tier's share of this node, or None without it.
      pusher: the replicas' pushes, or None without the peer tier.
      encoder: the parity shards' encodes, or None without the peer tier.
    """

    reporting: ReportSession
    room: RoomKeeper
    restorer: Restorer
    commits: CommitDetector
    busy_steps: BusySteps
    log_once: LogOnce
    backup: BackupWorker | None = None
    pusher: Pusher | None = None
    encoder: Encoder | None = None


@dataclasses.dataclass(frozen=True)
class _Links:
    """The sessions of one run: the coordinator's client and the peer session (whole steps move over it)."""

    client: CoordinatorClient
    peers: aiohttp.ClientSession


class NodeReplicator:
    """Drives the Orbax protocol, replication and garbage collection for every ramdisk of the node.

    Args:
      config: the node's settings; TLS contexts and timings are taken from it.
      coordinator_url: the coordinator's URL (``config.coordinator.url``: the agent makes a loop only with one).
      manager: the node's ramdisks.
      parts: the loop's collaborators (``agent.build_replicator``).
      peer_token: bearer tokens of the peer service and the coordinator (``config.peer.tokens()``), or None
        to run without the peer tier.
      grant_keys: with ``--peer-grants``, where the coordinator's grant keys are kept as its replies bring them
        (the peer service checks grants against them), or None.
    """

    def __init__(
        self,
        config: NodeConfig,
        coordinator_url: str,
        manager: RamdiskManager,
        parts: NodeParts,
        peer_token: Tokens | None = None,
        grant_keys: GrantKeys | None = None,
    ):
        self.node_id = config.node_id
        self._grant_keys = grant_keys
        self._manager = manager
        self._coordinator_url = coordinator_url
        self._peer_token = peer_token
        # Its proof of this node, read again after the kubelet rotates it (``Tokens``); None without one.
        self._node_token = Tokens(config.coordinator.node_token_file) if config.coordinator.node_token_file else None
        self._peer_ssl = config.peer.client_context()
        self._coordinator_ssl = tls.client_context(config.coordinator_ca)
        self._wedged_after_seconds = config.pacing.wedged_after_seconds
        self._busy_steps, self._log_once, self._room = parts.busy_steps, parts.log_once, parts.room
        self._backup, self._pusher, self._encoder = parts.backup, parts.pusher, parts.encoder
        self._restorer, self._commits, self._reporting = parts.restorer, parts.commits, parts.reporting
        self._assignments: dict[str, Assignment] = {}
        self._unsettled = handshake.UnsettledConfigs()
        self._listing: asyncio.Task | None = None
        self._workers: dict[JobRef, asyncio.Task] = {}
        self._beats: dict[JobRef | str, float] = {_ROUND: time.monotonic()}  # loop -> when it last completed a pass

    def poke(self) -> None:
        """Asks for a report now; safe to call from any thread (the gRPC servicer's)."""
        self._reporting.poke()

    def make_room(self, disk: Ramdisk, need: int, keep: int | None = None) -> None:
        """Gives up unsafe copies on ``disk`` until ``need`` bytes are free, but of step ``keep``
        (``RoomKeeper.make_room``)."""
        self._room.make_room(disk, need, keep)

    async def run(self, stop: asyncio.Event) -> None:
        """Reports and watches until ``stop`` is set."""
        self._reporting.bind(asyncio.get_running_loop())
        for disk in (await asyncio.to_thread(self._manager.ramdisks)).values():
            # Nothing is receiving, staging or deleting any more: finish what a crash interrupted.
            JobMeta(disk.path).sweep_partial()
            steps.sweep_trash(disk.client_dir)
        timeout = aiohttp.ClientTimeout(total=timing.REQUEST_TIMEOUT_SECONDS)
        peer_connector = aiohttp.TCPConnector(ssl=self._peer_ssl) if self._peer_ssl else None
        # Whole steps move over the peer session: no total timeout, a stalled read still fails.
        peer_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timing.PEER_CONNECT_TIMEOUT_SECONDS, sock_read=timing.PEER_READ_TIMEOUT_SECONDS
        )
        coordinator_connector = aiohttp.TCPConnector(
            ssl=self._coordinator_ssl or True, keepalive_timeout=timing.COORDINATOR_KEEPALIVE_SECONDS
        )
        async with (
            aiohttp.ClientSession(connector=coordinator_connector, timeout=timeout) as session,
            aiohttp.ClientSession(connector=peer_connector, timeout=peer_timeout) as peer_session,
        ):
            links = _Links(
                CoordinatorClient(session, self._coordinator_url, self._peer_token, self._node_token), peer_session
            )
            try:
                while not stop.is_set():
                    self._reporting.wake.clear()
                    try:
                        await self._round(links)
                    except Exception as err:  # one bad job or one bug must not stop every job on the node
                        LOOP_ERRORS.labels("report").inc()
                        log.exception("replicator round failed, carrying on: %r", err)
                    self._beat(_ROUND)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._reporting.wake.wait(), timing.ROUND_INTERVAL_SECONDS)
            finally:
                tasks = [
                    *self._workers.values(),
                    *(self._pusher.tasks() if self._pusher else []),
                    *(self._encoder.tasks() if self._encoder else []),
                    *([self._listing] if self._listing else []),
                ]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if self._backup:
                    await self._backup.stop()

    async def _round(self, links: _Links) -> None:
        disks = by_job(await asyncio.to_thread(self._manager.ramdisks))
        if self._backup and (self._listing is None or self._listing.done()):
            # In the background: a store outage must not hold up reports and restores. Only the
            # jobs the coordinator made this node the lister of (one node per job).
            listed = {k: d.path for k, d in disks.items() if k in self._reporting.list_backups}
            self._listing = asyncio.create_task(self._backup.refresh(listed))
        await self._report(links, disks)
        self._sync_workers(links, disks)

    def _beat(self, loop: JobRef | str) -> None:
        """Records that ``loop`` (the report round or a job's key) is alive (see ``healthy``)."""
        self._beats[loop] = time.monotonic()

    def _learn_grant_key(self, key: str | None) -> None:
        """Keeps the coordinator's grant key for the peer service (``--peer-grants``); says once if it has none."""
        if self._grant_keys is None:
            return
        try:
            if key is None:
                raise ValueError(
                    "--peer-grants is on but the coordinator issues no grants (its --peer-grants is off): "
                    "every peer refuses replicas and restores to and from this node"
                )
            self._grant_keys.learn(key)
        except ValueError as err:
            self._log_once("grant-key", str(err))

    def healthy(self) -> bool:
        """False when the report loop or a job's worker has not completed a round for
        ``wedged_after_seconds``: the agent is wedged and its livenessprobe should restart it."""
        now = time.monotonic()
        return all(now - beat < self._wedged_after_seconds for beat in self._beats.values())

    # -- reporting -----------------------------------------------------------------------------

    async def _report(self, links: _Links, disks: Mapping[JobRef, Ramdisk]) -> None:
        """Sends a report when something changed, when poked, or when a heartbeat is due."""
        report = await asyncio.to_thread(self._build_report, disks)
        reporting = self._reporting
        if not reporting.due(report, time.monotonic()):
            return
        reporting.poked = False
        started, sent = time.monotonic(), time.time()
        call = asyncio.ensure_future(links.client.report(report))
        if report.waiting:  # a long poll: give it up as soon as there is something new to say
            woken = asyncio.ensure_future(reporting.wake.wait())
            await asyncio.wait({call, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if not call.done():
                call.cancel()
                reporting.poked = True
                return
        try:
            reply = await call
        except CoordinatorUnavailable as err:
            reporting.failed(time.monotonic())
            self._log_once("report", f"coordinator unreachable, retrying: {err}")
            return
        REPORT_SECONDS.observe(time.monotonic() - started)
        LAST_REPORT.set_to_current_time()
        reporting.acknowledge(report, reply, time.monotonic())
        self._learn_grant_key(reply.grant_key)
        if reporting.poked:
            reporting.wake.set()
        self._assignments = {a.pod_uid: a for a in reply.assignments}
        for lineage in reply.lineages:
            if (disk := disks.get(JobRef(lineage.namespace, lineage.job))) is not None and JobMeta(
                disk.path
            ).learn_lineage(lineage.forks):
                log.warning(
                    "%s/%s: rolled back to step %d (timeline %d): deleting the abandoned timeline's copies",
                    disk.namespace,
                    disk.job,
                    lineage.forks[-1],
                    len(lineage.forks),
                )
                await asyncio.to_thread(drop_abandoned, disk)
        if self._pusher is not None:
            for order in reply.replicate:
                self._pusher.start(links.peers, disks, order)
        if self._encoder is not None:
            for encode in reply.encode:
                self._encoder.start(links.peers, disks, encode)
        self._room.learn(reply.retain, sent)
        for retain in reply.retain:
            if (disk := disks.get(JobRef(retain.namespace, retain.job))) is not None:
                await asyncio.to_thread(collect_garbage, disk, retain, self._busy_steps, started)
        if self._backup:
            # Orders are repeated with every reply: one missing from three heartbeats was withdrawn.
            self._backup.order_ttl_seconds = max(timing.MIN_BACKUP_ORDER_TTL_SECONDS, 3 * reply.heartbeat_seconds)
        for backup in reply.backup:
            if self._backup and (disk := disks.get(JobRef(backup.namespace, backup.job))) is not None:
                self._backup.start(disk.path, backup)

    def _build_report(self, disks: Mapping[JobRef, Ramdisk]) -> NodeReport:
        """The node's report (see ``ReportSession.build``), from its ramdisks."""
        pods, own, replicas, lineages, waiting, job_frameworks = [], [], [], [], False, {}
        shards: list[HeldShard] = []
        for job, disk in disks.items():
            meta = JobMeta(disk.path)
            shards += [shard.held(job) for shard in ParityShards(disk.path).held()]
            framework = job_frameworks[job] = meta.framework
            if forks := meta.lineage():
                lineages.append(Lineage(disk.namespace, disk.job, forks))
            for publication in disk.publications.values():
                spec = publication.spec
                progress = meta.progress(spec.pod_uid)
                pods.append(
                    PodReport(
                        namespace=spec.namespace,
                        job=spec.job,
                        pod_name=spec.pod_name,
                        pod_uid=spec.pod_uid,
                        slice_index=spec.slice_index,
                        worker_index=spec.worker_index,
                        nodes=spec.nodes or 1,
                        slices=spec.slices,
                        jax_coordinator_port=spec.jax_coordinator_port,
                        subdomain=spec.subdomain,
                        published_at=publication.published_at,
                        incarnation=progress.incarnation,
                        rank=progress.rank,
                        settings=progress.settings,
                        ranks_follow_data=framework.ranks_follow_data,
                        nodes_given=spec.nodes is not None,
                    )
                )
                waiting |= progress.incarnation is None and spec.pod_uid not in self._assignments
            present = set(framework.scan_steps(disk.client_dir).held)
            own += [
                OwnStep(HeldCopy(job, step, m.rank, m.timeline), m.files)
                for step, m in meta.manifests().items()
                if step in present
            ]
            mine = {(m.rank, step) for step, m in meta.manifests().items()}
            replicas += [
                HeldCopy(job, step, rank, m.timeline, files_digest(m.files))
                for (rank, step), m in meta.replicas().items()
                if (rank, step) not in mine
            ]
        backed_up = self._backup.listing.values() if self._backup else ()
        return self._reporting.build(pods, own, replicas, backed_up, waiting, lineages, job_frameworks, shards)

    # -- per-job workers -----------------------------------------------------------------------

    def _sync_workers(self, links: _Links, disks: Mapping[JobRef, Ramdisk]) -> None:
        for key in [k for k in self._workers if k not in disks or self._workers[k].done()]:
            task = self._workers.pop(key)
            if task.done() and not task.cancelled() and task.exception():
                log.error("worker for %s failed: %r", key, task.exception())
            task.cancel()
        for key, disk in disks.items():
            if key not in self._workers and disk.publications:
                self._workers[key] = asyncio.create_task(
                    self._watch(links, key), name=f"watch-{key.namespace}-{key.job}"
                )

    async def _watch(self, links: _Links, key: JobRef) -> None:
        try:
            while await self._watch_once(links, key):
                self._beat(key)
                await asyncio.sleep(timing.WATCH_INTERVAL_SECONDS)
        finally:
            self._beats.pop(key, None)
            self._unsettled.forget(key)

    async def _watch_once(self, links: _Links, key: JobRef) -> bool:
        """One pass over a job's ramdisk; False once no pod has it published. An error is logged,
        counted and retried on the next pass: it never stops the job's protocol for good."""
        # A stat; the state file is parsed only when it changed. The CSI driver keys by (namespace, job).
        disk = self._manager.ramdisks().get((key.namespace, key.job))
        spec = handshake.current_pod(disk) if disk else None
        if disk is None or spec is None:
            return False
        try:
            meta = JobMeta(disk.path)
            progress = meta.progress(spec.pod_uid)
            assignment = self._assignments.get(progress.pod_uid)
            progress = handshake.apply_assignment(disk, meta, progress, assignment)
            # The job's size: the volume's ``nodes``, else the incarnation's (the API server's shape); unknown
            # until this agent has the assignment again (after its restart), when the file waits a pass.
            nodes = spec.nodes or (assignment.nodes or 1 if assignment else None)
            if progress.jax_init_written and progress.settings is None and nodes is not None:
                await handshake.consume_replicator_yaml(
                    links.client, disk, meta, progress, nodes, self._log_once, self._unsettled
                )
            if progress.settings is not None and not progress.restore_done:
                await self._restorer.restore(links.client, links.peers, disk, meta, progress, lambda: self._beat(key))
            await self._commits.detect(disk, meta, progress)
            if progress.restore_done:
                await asyncio.to_thread(self._room.keep_room, key, disk, meta, progress)
        except Exception as err:
            LOOP_ERRORS.labels("job").inc()
            self._log_once(f"watch-{key}", f"{key}: error in the job's protocol loop, retrying: {err!r}")
        return True
