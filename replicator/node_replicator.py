"""The node agent's side of the Orbax protocol, for every job ramdisk on the node.

- Reports the node's pods and committed steps to the coordinator: at once on a change, else as a
  heartbeat at the pace the coordinator sets. A step's checksums are sent once per coordinator.
- Writes ``jax-init-info.txt`` once the coordinator assigns the pod a rank.
- Validates and consumes ``replicator.yaml``; bad content goes to ``replicator.failed``.
- Detects committed steps and checksums them.
- Runs the restore: stage and verify the agreed step, wait until every rank has, then write the marker.
"""

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import ssl
import time

import aiohttp
from prometheus_client import Counter, Gauge, Histogram

from csi_driver.ramdisk import Ramdisk, RamdiskManager
from prefetch import staging
from prefetch.peer_fetch import PeerFetchError, fetch_manifest, fetch_step, push_step
from replicator import orbax_protocol, pod_files
from replicator.job_meta import JobMeta, PodProgress
from replicator.backup_store import BackupError, BackupStore
from replicator.backup_worker import BackupWorker
from replicator.bearer import auth_header
from replicator.cpu_share import CpuShare
from replicator.messages import (
    MAX_WAIT_SECONDS,
    Assignment,
    JobSettings,
    Lineage,
    NodeReport,
    PodReport,
    ReportReply,
    RestoreView,
    Source,
    Target,
    abandoned,
    check_version,
    decode,
    to_json,
)
from replicator.report_session import ReportSession
from replicator.step_manifest import StepManifest, UnusableCopy, build_manifest

log = logging.getLogger(__name__)

NEWEST_STEP = Gauge("mtc_newest_committed_step", "Newest committed local step", ["namespace", "job", "rank"])
# Buckets up to Orbax's 300 s wait for the marker; 150 s (half of it) is an alert threshold.
RESTORE_SECONDS = Histogram("mtc_restore_seconds", "Seconds from replicator.yaml consumed to restore marker written "
                            "(source timeout: no marker within the deadline)", ["source"],
                            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 150, 270, 300))  # fmt: skip
REPLICATOR_YAML = Counter("mtc_replicator_yaml_total", "replicator.yaml files consumed", ["result"])
CORRUPT_COPIES = Counter("mtc_corrupt_copies_total", "Step copies that failed checksum verification")
REPLICATED = Counter("mtc_replicated_steps_total", "Steps pushed to a peer", ["result"])
REFUSED_STEPS = Counter("mtc_refused_steps_total", "Committed steps refused: they hold a symlink, FIFO, device or socket, or cannot be walked")
LOOP_ERRORS = Counter("mtc_replicator_loop_errors_total", "Errors caught in the replicator's loops, which carried on", ["loop"])
REPLICATED_BYTES = Counter("mtc_replicated_bytes_total", "Bytes of step data pushed to peers")
GC_DELETED = Counter("mtc_gc_deleted_steps_total", "Steps and replicas deleted by garbage collection")
REPORT_SECONDS = Histogram("mtc_coordinator_report_seconds", "Round trip of one report to the coordinator, seconds")
LAST_REPORT = Gauge("mtc_coordinator_last_report_timestamp_seconds", "Unix time of the last report the coordinator answered")
# Known label values start at zero, so dashboards and alerts see the series before the first event.
for _label in ("local", "peer", "backup", "none", "timeout"):
    RESTORE_SECONDS.labels(_label)
for _label in ("ok", "failed"):
    REPLICATED.labels(_label)
for _label in ("report", "job"):
    LOOP_ERRORS.labels(_label)

# The report loop looks for changes this often; a report goes out only on a change or a heartbeat.
_ROUND_INTERVAL_SECONDS = 1.0
_REQUEST_TIMEOUT_SECONDS = 10.0
# A loop that has not completed a pass for this long is wedged: /healthz and CSI Probe say so, and
# the DaemonSet's livenessprobe restarts the agent. Well above the longest legitimate pass (a 10 s
# report timeout plus GC of a few steps).
_WEDGED_AFTER_SECONDS = 120.0
_ROUND = "report-round"
_WATCH_INTERVAL_SECONDS = 0.2
_RESTORE_DEADLINE_SECONDS = 270.0  # Orbax waits 300 s for the marker
_ERROR_REPEAT_SECONDS = 30.0
# An unreachable restore source (a restarting agent, a frozen node, a network blip) is retried with
# this backoff for as long as Orbax waits; only a proven mismatch gives a copy up.
_RETRY_FIRST_SECONDS = 1.0
_RETRY_MAX_SECONDS = 10.0
_PUSH_REPEAT_SECONDS = 30.0
# Replicas of a step are superseded by the next one: a job saving faster than this replicates
# only its newest step, so the agent's CPU use stays bounded however often the job saves.
_MIN_PUSH_INTERVAL_SECONDS = 2.0


class CoordinatorUnavailable(Exception):
    """The coordinator could not be reached or refused the request."""


class CoordinatorClient:
    """The node agent's HTTP client of the coordinator."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None):
        self._session = session
        self._base = base_url.rstrip("/")
        self._headers = auth_header(token) if token else {}

    async def _call(self, method: str, path: str, wait: float = 0.0, **kwargs) -> dict:
        """One request; a long poll (``wait`` seconds) gets that much more time."""
        timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_SECONDS + wait)
        try:
            async with self._session.request(method, self._base + path, headers=self._headers, timeout=timeout, **kwargs) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise CoordinatorUnavailable(f"{method} {path}: HTTP {response.status}: {body.get('error', body)}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            raise CoordinatorUnavailable(f"{method} {path}: {err!r}") from None

    async def report(self, report: NodeReport) -> ReportReply:
        """Sends a report; a ``waiting`` one may be held by the coordinator (long poll).

        Raises:
          CoordinatorUnavailable: unreachable, refused, or of another protocol version (named).
        """
        body = await self._call("POST", "/v1/report", wait=MAX_WAIT_SECONDS if report.waiting else 0.0, json=to_json(report))
        try:
            reply = decode(body, ReportReply)
            check_version(reply.protocol, "the coordinator")
        except ValueError as err:
            raise CoordinatorUnavailable(f"POST /v1/report: {err}") from None
        return reply

    async def record_settings(self, disk: Ramdisk, progress: PodProgress, settings: JobSettings) -> None:
        payload = {"incarnation": progress.incarnation, "rank": progress.rank, "settings": to_json(settings)}
        await self._call("POST", f"/v1/jobs/{disk.namespace}/{disk.job}/settings", json=payload)

    async def restore_view(self, disk: Ramdisk, progress: PodProgress, seen: str | None = None) -> RestoreView:
        """The rank's restore view; with ``seen`` (a view's ``token``), a long poll that returns
        once the view differs from it, or after ``MAX_WAIT_SECONDS``."""
        params = {"incarnation": progress.incarnation, "rank": str(progress.rank)}
        wait = MAX_WAIT_SECONDS if seen is not None else 0.0
        if seen is not None:
            params |= {"seen": seen, "wait": str(wait)}
        return decode(await self._call("GET", f"/v1/jobs/{disk.namespace}/{disk.job}/restore", wait=wait, params=params), RestoreView)

    async def report_staged(self, disk: Ramdisk, progress: PodProgress, generation: str, source: str | None, bad: list,
                            retrying: bool = False) -> None:  # fmt: skip
        payload = {"incarnation": progress.incarnation, "generation": generation, "rank": progress.rank, "source": source,
                   "bad": bad, "retrying": retrying}  # fmt: skip
        await self._call("POST", f"/v1/jobs/{disk.namespace}/{disk.job}/restore", json=payload)


def report_to_job(meta: JobMeta, message: str) -> None:
    """Appends ``message`` to the job's ``replicator.errors`` (its content kept in ``meta``)."""
    orbax_protocol.report_error(meta.client_dir, meta.root, message)


@dataclasses.dataclass(frozen=True)
class _Failed:
    """Why a source did not serve; ``unusable`` when that is proven (a checksum mismatch, the copy
    is gone), False when it was merely unreachable and is worth retrying."""

    problems: list[str]
    unusable: bool


def _differs_from_owner(manifest: StepManifest, source: Source) -> str | None:
    """A problem when the checksums a copy was verified against are not those its owning rank
    reported (carried in the plan); the bytes were checked against ``manifest``, so equal manifests
    mean they match the owner's."""
    if source.files is not None and manifest.files != source.files:
        return f"crc32c mismatch: the copy on {source.holder} does not match the checksums rank {source.data_rank} reported"
    return None


def current_pod(disk: Ramdisk):
    """The newest publication of the ramdisk: the job's pod on this node (one per node)."""
    return max(disk.publications.values(), key=lambda p: p.published_at).spec if disk.publications else None


class NodeReplicator:
    """Drives the Orbax protocol, replication and garbage collection for every ramdisk of the node.

    Args:
      node_id, url, pod_address, topology: what the node reports about itself.
      manager: the node's ramdisks.
      coordinator_url: the coordinator's base URL.
      peer_token: bearer token of the peer service, or None to run without the peer tier.
      replicas: peers that should hold replicas of this node's steps (data parallelism 1).
      backup_store: the backup tier, or None to run without it.
      backup_keep: complete backups to keep per job.
      peer_ssl: TLS context for calls to peers, or None for aiohttp's default.
      coordinator_ssl: TLS context for calls to the coordinator, or None for aiohttp's default.
      share: the CPU cap of replication and backup while jobs train, or None (restores never pace).
    """

    def __init__(
        self,
        node_id: str,
        url: str,
        pod_address: str | None,
        topology: dict[str, str],
        manager: RamdiskManager,
        coordinator_url: str,
        peer_token: str | None = None,
        replicas: int = 1,
        backup_store: BackupStore | None = None,
        backup_keep: int = 3,
        peer_ssl: ssl.SSLContext | None = None,
        coordinator_ssl: ssl.SSLContext | None = None,
        share: CpuShare | None = None,
    ):
        self.node_id = node_id
        self._manager = manager
        self._coordinator_url = coordinator_url
        self._peer_token = peer_token
        self._peer_ssl = peer_ssl
        self._coordinator_ssl = coordinator_ssl
        self._share = share
        self._session: aiohttp.ClientSession | None = None
        self._pushes: dict[tuple, asyncio.Task] = {}
        self._pushed: dict[tuple, float] = {}  # push key -> when it succeeded
        self._push_started: dict[tuple[str, str, str], float] = {}  # (namespace, job, target) -> monotonic
        self._busy_steps: set[tuple[str, str, int]] = set()  # (namespace, job, step) being read: GC keeps them
        self._assignments: dict[str, Assignment] = {}
        self._backup = (
            BackupWorker(backup_store, backup_keep, self._busy_steps, self._error_to_job, self.poke, share) if backup_store else None
        )
        self._listing: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._reporting = ReportSession(node_id, url, pod_address, topology, replicas, backup_store is not None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: dict[tuple[str, str], asyncio.Task] = {}
        self._last_error: dict[str, float] = {}
        self._refused: dict[tuple[str, str], set[int]] = {}  # steps never to checksum again, per job
        self._beats: dict[object, float] = {_ROUND: time.monotonic()}  # loop -> when it last completed a pass

    def poke(self) -> None:
        """Asks for a report now; safe to call from any thread (the gRPC servicer's)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._poke_now)

    def _poke_now(self) -> None:
        self._reporting.poked = True
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reports and watches until ``stop`` is set."""
        self._loop = asyncio.get_running_loop()
        for disk in (await asyncio.to_thread(self._manager.ramdisks)).values():
            # Nothing is receiving, staging or deleting any more: finish what a crash interrupted.
            JobMeta(disk.path).sweep_partial()
            staging.sweep_trash(disk.client_dir)
        timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_SECONDS)
        peer_connector = aiohttp.TCPConnector(ssl=self._peer_ssl) if self._peer_ssl else None
        # Whole steps move over the peer session: no total timeout, a stalled read still fails.
        peer_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
        coordinator_connector = aiohttp.TCPConnector(ssl=self._coordinator_ssl) if self._coordinator_ssl else None
        async with aiohttp.ClientSession(connector=coordinator_connector, timeout=timeout) as session, aiohttp.ClientSession(
            connector=peer_connector, timeout=peer_timeout
        ) as peer_session:
            self._session = peer_session
            client = CoordinatorClient(session, self._coordinator_url, self._peer_token)
            try:
                while not stop.is_set():
                    self._wake.clear()
                    try:
                        await self._round(client)
                    except Exception as err:  # one bad job or one bug must not stop every job on the node
                        LOOP_ERRORS.labels("report").inc()
                        log.exception("replicator round failed, carrying on: %r", err)
                    self._beats[_ROUND] = time.monotonic()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), _ROUND_INTERVAL_SECONDS)
            finally:
                tasks = [*self._workers.values(), *self._pushes.values(), *([self._listing] if self._listing else [])]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if self._backup:
                    await self._backup.stop()

    async def _round(self, client: CoordinatorClient) -> None:
        disks = await asyncio.to_thread(self._manager.ramdisks)
        if self._backup and (self._listing is None or self._listing.done()):
            # In the background: a store outage must not hold up reports and restores. Only the
            # jobs the coordinator made this node the lister of (one node per job).
            listed = {k: d.path for k, d in disks.items() if k in self._reporting.list_backups}
            self._listing = asyncio.create_task(self._backup.refresh(listed))
        await self._report(client, disks)
        self._sync_workers(client, disks)

    def healthy(self) -> bool:
        """False when the report loop or a job's worker has not completed a round for
        ``_WEDGED_AFTER_SECONDS``: the agent is wedged and its livenessprobe should restart it."""
        now = time.monotonic()
        return all(now - beat < _WEDGED_AFTER_SECONDS for beat in self._beats.values())

    # -- reporting -----------------------------------------------------------------------------

    async def _report(self, client: CoordinatorClient, disks: dict) -> None:
        """Sends a report when something changed, when poked, or when a heartbeat is due."""
        report = await asyncio.to_thread(self._build_report, disks)
        reporting = self._reporting
        if not reporting.due(report, time.monotonic()):
            return
        reporting.poked = False
        started = time.monotonic()
        call = asyncio.ensure_future(client.report(report))
        if report.waiting:  # a long poll: give it up as soon as there is something new to say
            woken = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({call, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if not call.done():
                call.cancel()
                reporting.poked = True
                return
        try:
            reply = await call
        except CoordinatorUnavailable as err:
            self._log_once("report", f"coordinator unreachable, retrying: {err}")
            return
        REPORT_SECONDS.observe(time.monotonic() - started)
        LAST_REPORT.set_to_current_time()
        reporting.acknowledge(report, reply, time.monotonic())
        if reporting.poked:
            self._wake.set()
        self._assignments = {a.pod_uid: a for a in reply.assignments}
        for lineage in reply.lineages:
            if (disk := disks.get((lineage.namespace, lineage.job))) is not None and JobMeta(disk.path).learn_lineage(lineage.forks):
                log.warning("%s/%s: rolled back to step %d (timeline %d): deleting the abandoned timeline's copies",
                            disk.namespace, disk.job, lineage.forks[-1], len(lineage.forks))  # fmt: skip
                await asyncio.to_thread(self._drop_abandoned, disk)
        if self._peer_token is not None:
            for order in reply.replicate:
                self._start_pushes(disks, order)
        for order in reply.retain:
            if (disk := disks.get((order.namespace, order.job))) is not None:
                await asyncio.to_thread(self._collect_garbage, disk, order)
        if self._backup:
            # Orders are repeated with every reply: one missing from three heartbeats was withdrawn.
            self._backup.order_ttl_seconds = max(10.0, 3 * reply.heartbeat_seconds)
        for order in reply.backup:
            if self._backup and (disk := disks.get((order.namespace, order.job))) is not None:
                self._backup.start(disk.path, order)

    def _build_report(self, disks: dict) -> NodeReport:
        """The node's report (see ``ReportSession.build``), from its ramdisks."""
        pods, own, replicas, lineages, waiting = [], [], [], [], False
        for disk in disks.values():
            meta = JobMeta(disk.path)
            if forks := meta.lineage():
                lineages.append(Lineage(disk.namespace, disk.job, forks))
            for publication in disk.publications.values():
                spec = publication.spec
                progress = meta.progress(spec.pod_uid)
                pods.append(PodReport(
                    namespace=spec.namespace, job=spec.job, pod_name=spec.pod_name, pod_uid=spec.pod_uid,
                    slice_index=spec.slice_index, worker_index=spec.worker_index, nodes=spec.nodes or 1,
                    slices=spec.slices, jax_coordinator_port=spec.jax_coordinator_port, subdomain=spec.subdomain,
                    published_at=publication.published_at, incarnation=progress.incarnation, rank=progress.rank,
                    settings=progress.settings,
                ))  # fmt: skip
                waiting |= progress.incarnation is None and spec.pod_uid not in self._assignments
            present = set(orbax_protocol.held_steps(disk.client_dir))
            own += [(disk.namespace, disk.job, step, m.rank, m.files, m.timeline) for step, m in meta.manifests().items() if step in present]
            mine = {(m.rank, step) for step, m in meta.manifests().items()}
            replicas += [(disk.namespace, disk.job, step, rank, m.timeline) for (rank, step), m in meta.replicas().items() if (rank, step) not in mine]
        backed_up = self._backup.listing.values() if self._backup else ()
        return self._reporting.build(pods, own, replicas, backed_up, waiting, lineages)

    # -- replication and garbage collection ----------------------------------------------------

    def _start_pushes(self, disks: dict, order) -> None:
        disk = disks.get((order.namespace, order.job))
        if disk is None:
            return
        now = time.monotonic()
        self._pushes = {k: t for k, t in self._pushes.items() if not t.done()}
        self._pushed = {k: t for k, t in self._pushed.items() if now - t < _PUSH_REPEAT_SECONDS}
        for target in order.targets:
            key = (order.namespace, order.job, order.rank, order.step, target.node)
            lane = (order.namespace, order.job, target.node)
            # The coordinator learns of a finished push only from the target's next report.
            if key in self._pushes or key in self._pushed or now - self._push_started.get(lane, -1e9) < _MIN_PUSH_INTERVAL_SECONDS:
                continue
            self._push_started[lane] = now
            self._pushes[key] = asyncio.create_task(self._push(disk, order, target, key))

    async def _push(self, disk: Ramdisk, order, target: Target, key: tuple) -> None:
        """Pushes one committed step to one peer; the peer verifies it before it becomes visible."""
        meta = JobMeta(disk.path)
        located = meta.locate(order.rank, order.step)
        if located is None:
            return
        busy = (disk.namespace, disk.job, order.step)
        self._busy_steps.add(busy)
        started = time.monotonic()
        try:
            step_dir, manifest = located
            await push_step(self._session, target.url, self._peer_token, disk.namespace, disk.job, step_dir, manifest,
                            share=self._share)  # fmt: skip
            REPLICATED.labels("ok").inc()
            REPLICATED_BYTES.inc(manifest.total_bytes)
            self._pushed[key] = time.monotonic()
            log.info("%s/%s: replicated step %d of rank %d to %s in %.2f s (%d bytes)", disk.namespace, disk.job,
                     order.step, order.rank, target.node, time.monotonic() - started, manifest.total_bytes)  # fmt: skip
        except (PeerFetchError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as err:
            REPLICATED.labels("failed").inc()
            self._log_once(f"push-{target.node}", f"replicating step {order.step} to {target.node} failed: {err}")
        finally:
            self._busy_steps.discard(busy)

    def _drop_abandoned(self, disk: Ramdisk) -> None:
        """Deletes the job's own steps and replicas of timelines a rollback abandoned
        (``messages.abandoned``): they are never restored again, and their step numbers are reused."""
        meta = JobMeta(disk.path)
        forks = meta.lineage()
        if not forks:
            return
        for step, manifest in meta.manifests().items():
            if abandoned(forks, step, manifest.timeline):
                meta.drop_manifest(step)  # first: a step is never reported once its deletion began
                staging.delete_step(disk.client_dir, step)
                GC_DELETED.inc()
        for (rank, step), manifest in meta.replicas().items():
            if abandoned(forks, step, manifest.timeline):
                meta.drop_replica(rank, step)
                GC_DELETED.inc()

    def _collect_garbage(self, disk: Ramdisk, order) -> None:
        """Deletes own steps and replicas older than the newest safe step (see ``RetainOrder``), the
        steps the pod's restore set aside once a step newer than the restored one is safe, and
        copies of abandoned timelines (finishing a deletion an agent restart interrupted)."""
        self._drop_abandoned(disk)
        meta = JobMeta(disk.path)
        keep = set(order.protected) | {step for ns, job, step in self._busy_steps if (ns, job) == (disk.namespace, disk.job)}
        for step in meta.manifests():
            if step < order.keep_from and step not in keep:
                meta.drop_manifest(step)  # first: a step is never reported once its deletion began
                staging.delete_step(disk.client_dir, step)
                GC_DELETED.inc()
        spec = current_pod(disk)
        progress = meta.progress(spec.pod_uid) if spec else None
        restored = progress.handing_over if progress and progress.restore_done else None
        for rank, step in meta.replicas():
            set_aside = progress is not None and rank == progress.rank and restored is not None
            if (step < order.keep_from or (set_aside and order.keep_from > restored)) and step not in keep:
                meta.drop_replica(rank, step)
                GC_DELETED.inc()

    def _error_to_job(self, meta: JobMeta, message: str) -> None:
        self._log_once(f"job-error-{meta.root}", message, meta)

    def _log_once(self, key: str, message: str, meta: JobMeta | None = None) -> None:
        """Logs (and reports to ``replicator.errors``) at most every 30 s per key."""
        now = time.monotonic()
        if now - self._last_error.get(key, -_ERROR_REPEAT_SECONDS) >= _ERROR_REPEAT_SECONDS:
            self._last_error[key] = now
            log.warning("%s", message)
            if meta is not None:
                report_to_job(meta, message)

    # -- per-job workers -----------------------------------------------------------------------

    def _sync_workers(self, client: CoordinatorClient, disks: dict) -> None:
        for key in [k for k in self._workers if k not in disks or self._workers[k].done()]:
            task = self._workers.pop(key)
            if task.done() and not task.cancelled() and task.exception():
                log.error("worker for %s/%s failed: %r", *key, task.exception())
            task.cancel()
        for key, disk in disks.items():
            if key not in self._workers and disk.publications:
                self._workers[key] = asyncio.create_task(self._watch(client, key), name=f"watch-{key[0]}-{key[1]}")

    async def _watch(self, client: CoordinatorClient, key: tuple[str, str]) -> None:
        try:
            while await self._watch_once(client, key):
                self._beats[key] = time.monotonic()
                await asyncio.sleep(_WATCH_INTERVAL_SECONDS)
        finally:
            self._beats.pop(key, None)

    async def _watch_once(self, client: CoordinatorClient, key: tuple[str, str]) -> bool:
        """One pass over a job's ramdisk; False once no pod has it published. An error is logged,
        counted and retried on the next pass: it never stops the job's protocol for good."""
        disk = self._manager.ramdisks().get(key)  # a stat; the state file is parsed only when it changed
        spec = current_pod(disk) if disk else None
        if spec is None:
            return False
        try:
            meta = JobMeta(disk.path)
            progress = meta.progress(spec.pod_uid)
            progress = self._apply_assignment(disk, meta, progress)
            if progress.jax_init_written and progress.settings is None:
                await self._consume_replicator_yaml(client, disk, meta, progress, spec.nodes or 1)
            if progress.settings is not None and not progress.restore_done:
                await self._restore(client, disk, meta, progress)
            await self._detect_commits(disk, meta, progress)
        except Exception as err:
            LOOP_ERRORS.labels("job").inc()
            self._log_once(f"watch-{key}", f"{key[0]}/{key[1]}: error in the job's protocol loop, retrying: {err!r}")
        return True

    def _apply_assignment(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> PodProgress:
        """Writes ``jax-init-info.txt`` for a new assignment; returns the pod's progress after it."""
        assignment = self._assignments.get(progress.pod_uid)
        if assignment is None or assignment.incarnation == progress.incarnation:
            return progress
        orbax_protocol.write_jax_init_info(disk.client_dir, assignment.rank, assignment.jax_coordinator)
        progress = PodProgress(progress.pod_uid, assignment.incarnation, assignment.rank, assignment.jax_coordinator, jax_init_written=True)
        meta.save_progress(progress)
        log.info("%s/%s: pod %s is rank %d of incarnation %s (JAX coordinator %s)",
                 disk.namespace, disk.job, progress.pod_uid, assignment.rank, assignment.incarnation, assignment.jax_coordinator)  # fmt: skip
        return progress

    async def _consume_replicator_yaml(self, client, disk: Ramdisk, meta: JobMeta, progress: PodProgress, nodes: int) -> None:
        try:
            text = orbax_protocol.read_replicator_yaml(disk.client_dir)
            if text is None:
                return
            config = orbax_protocol.parse_replicator_config(text, progress.rank, nodes)
        except (orbax_protocol.InvalidReplicatorConfig, pod_files.UnsafeEntry, UnicodeDecodeError) as err:
            message = str(err) if isinstance(err, orbax_protocol.InvalidReplicatorConfig) else f"replicator.yaml is unusable: {err}"
            log.error("%s/%s: rejected replicator.yaml: %s", disk.namespace, disk.job, message)
            orbax_protocol.report_failure(disk.client_dir, meta.root, message)
            orbax_protocol.consume_replicator_yaml(disk.client_dir)  # Orbax reads replicator.failed only once the yaml is gone
            REPLICATOR_YAML.labels("rejected").inc()
            return
        settings = JobSettings(config.peer_ranks, config.data_parallelism, config.backup_interval_minutes, config.backup_interval_steps)
        try:
            await client.record_settings(disk, progress, settings)
        except CoordinatorUnavailable as err:
            self._log_once(f"settings-{disk.job}", f"cannot record job settings with the coordinator, retrying: {err}", meta)
            return
        progress.settings = settings
        meta.save_progress(progress)
        orbax_protocol.consume_replicator_yaml(disk.client_dir)
        REPLICATOR_YAML.labels("accepted").inc()
        log.info("%s/%s rank %d: consumed replicator.yaml %s", disk.namespace, disk.job, progress.rank, settings)

    async def _restore(self, client, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        if progress.handing_over is not None:  # staged and agreed before a crash: finish the hand-over only
            await asyncio.to_thread(self._hand_over, disk, meta, progress, None if progress.handing_over < 0 else progress.handing_over, "resumed")
            return
        started = time.monotonic()
        staged_generation, source, backoff, seen = None, "none", _RETRY_FIRST_SECONDS, None
        unusable: set[tuple[str, str, int]] = set()  # (generation, holder, data rank) proven unusable here
        while time.monotonic() - started < _RESTORE_DEADLINE_SECONDS:
            self._beats[(disk.namespace, disk.job)] = time.monotonic()
            try:
                view = await client.restore_view(disk, progress, seen)
                seen = None
                if view.step is not None and view.generation != staged_generation:
                    used, bad, unreachable = await self._stage(disk, meta, progress, view, unusable)
                    unusable.update((view.generation, holder, rank) for _, rank, holder in bad)
                    if used is None and unreachable:
                        # Transient is not corrupt: report only proven-bad copies, retry the rest.
                        if bad:
                            await client.report_staged(disk, progress, view.generation, None, bad, retrying=True)
                        self._log_once(f"restore-retry-{disk.job}", f"step {view.step}: sources unreachable "
                                       f"({'; '.join(unreachable[:3])}); retrying in {backoff:.0f} s", meta)  # fmt: skip
                        await asyncio.sleep(backoff)
                        backoff = min(2 * backoff, _RETRY_MAX_SECONDS)
                        continue
                    source = used.tier if used else "none"
                    await client.report_staged(disk, progress, view.generation, used and f"{used.tier}:{used.holder}", bad)
                    staged_generation, backoff = view.generation, _RETRY_FIRST_SECONDS
                    continue
            except CoordinatorUnavailable as err:
                self._log_once(f"restore-{disk.job}", f"restore plan unavailable, retrying: {err}", meta)
                await asyncio.sleep(1.0)
                continue
            if view.ready:
                await asyncio.to_thread(self._hand_over, disk, meta, progress, view.step, source, view.forks, not view.rollback)
                RESTORE_SECONDS.labels(source).observe(time.monotonic() - started)
                return
            seen = view.token  # staged: wait (long poll) until every rank has, or the plan changes
        RESTORE_SECONDS.labels("timeout").observe(time.monotonic() - started)
        report_to_job(meta, f"restore did not complete within {_RESTORE_DEADLINE_SECONDS:.0f} s")

    async def _stage(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress, view: RestoreView,
                     unusable: set[tuple[str, str, int]]) -> tuple[Source | None, list, list[str]]:  # fmt: skip
        """Stages the view's step from its first source that serves a verified copy.

        Args:
          unusable: (generation, holder, data rank) already proven unusable: not tried again.

        Returns:
          The source used (None if none served); the copies proven unusable, as (step, data rank,
          holder); and what went wrong with sources that were merely unreachable (to retry).
        """
        bad, unreachable = [], []
        for source in view.sources:
            if (view.generation, source.holder, source.data_rank) in unusable:
                continue
            if source.files is not None and not orbax_protocol.has_commit_evidence(source.files):
                failed = _Failed([f"its checksums lack {orbax_protocol.COMMIT_EVIDENCE}"], unusable=True)
            elif source.holder == self.node_id and source.data_rank == progress.rank:
                problems = await asyncio.to_thread(staging.stage_local, disk.client_dir, view.step, meta.manifests().get(view.step),
                                                   meta, progress.rank)  # fmt: skip
                failed = _Failed(problems, unusable=True) if problems else None
            elif source.tier == "backup":
                failed = await self._stage_from_backup(disk, meta, progress, view, source)
            else:
                failed = await self._stage_from_peer(disk, meta, progress, view, source)
            if failed is None:
                log.info("%s/%s rank %d: staged step %d from %s %s (data of rank %d)", disk.namespace, disk.job,
                         progress.rank, view.step, source.tier, source.holder, source.data_rank)  # fmt: skip
                return source, bad, unreachable
            if not failed.unusable:
                unreachable.append(f"{source.holder}: {failed.problems[0]}")
                continue
            if any("mismatch" in problem for problem in failed.problems):
                CORRUPT_COPIES.inc()
            message = f"step {view.step} copy on {source.holder} unusable: {'; '.join(failed.problems[:3])}"
            log.error("%s/%s rank %d: %s", disk.namespace, disk.job, progress.rank, message)
            report_to_job(meta, message)
            bad.append((view.step, source.data_rank, source.holder))
        return None, bad, unreachable

    async def _stage_from_peer(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress, view: RestoreView, source: Source) -> "_Failed | None":
        """Pulls the view's step from a peer (or this node's own replica) into the ramdisk, verified,
        then stages it; it is this rank's copy of the step from then on, in the view's timeline."""
        step = view.step
        if self._peer_token is None or not source.url:
            return _Failed([f"peer tier unavailable for {source.holder}"], unusable=True)
        incoming = meta.new_incoming_dir()
        try:
            # Verified against the owner's checksums from the plan; the peer's own manifest only when the plan has none.
            manifest = (StepManifest(step, source.data_rank, dict(source.files)) if source.files is not None else
                        await fetch_manifest(self._session, source.url, self._peer_token, disk.namespace, disk.job, source.data_rank, step))
            await fetch_step(source.url, self._peer_token, disk.namespace, disk.job, manifest, incoming, ssl_context=self._peer_ssl)
        except (PeerFetchError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as err:
            shutil.rmtree(incoming, ignore_errors=True)
            return _Failed([str(err) or repr(err)], unusable=isinstance(err, UnusableCopy))
        await asyncio.to_thread(staging.install_staged, disk.client_dir, step, incoming)
        # Recorded as this rank's step: from now on this node serves it for this rank.
        meta.save_manifest(dataclasses.replace(manifest, rank=progress.rank, timeline=len(view.forks)))
        return None

    async def _stage_from_backup(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress, view: RestoreView, source: Source) -> "_Failed | None":
        """Downloads the view's step from the backup tier into the ramdisk, verified, then stages it."""
        step = view.step
        if self._backup is None:
            return _Failed(["no backup tier on this node (--backup)"], unusable=True)
        try:
            verified, manifest = await self._backup.download(meta, disk.namespace, disk.job, step, source.data_rank, source.timeline)
        except (BackupError, OSError) as err:
            return _Failed([str(err) or repr(err)], unusable=isinstance(err, UnusableCopy))
        if (problem := _differs_from_owner(manifest, source)) is not None:
            shutil.rmtree(os.path.dirname(verified), ignore_errors=True)
            return _Failed([problem], unusable=True)
        await asyncio.to_thread(staging.install_staged, disk.client_dir, step, verified)
        meta.save_manifest(dataclasses.replace(manifest, rank=progress.rank, timeline=len(view.forks)))
        return None

    def _hand_over(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress, step: int | None, source: str,
                   forks: tuple[int, ...] = (), set_aside: bool = True) -> None:  # fmt: skip
        """Records the job's timeline (``forks``: training after the marker writes in it), sets aside
        steps newer than the agreed one (deletes them for a rollback: ``set_aside`` False) and writes
        the marker. Idempotent: replayed after a crash (``handing_over`` recorded, ``restore_done``
        not), it never clears again, since training may have saved steps since, and writes the marker
        only if Orbax has not taken it."""
        if meta.learn_lineage(forks):
            self._drop_abandoned(disk)
        if progress.handing_over is None:
            progress.handing_over = -1 if step is None else step
            meta.save_progress(progress)
            staging.clear_for_restore(disk.client_dir, step, meta, progress.rank, set_aside)
            marker_needed = True
        else:
            scan = orbax_protocol.scan_steps(disk.client_dir)
            marker_needed = not scan.committed if step is None else step in scan.staged and step not in scan.committed
            log.warning("%s/%s rank %d: resuming an interrupted hand-over of step %s (marker %s)", disk.namespace, disk.job,
                        progress.rank, step, "rewritten" if marker_needed else "already taken")  # fmt: skip
        if marker_needed and step is None:
            orbax_protocol.write_fresh_start_marker(disk.client_dir, disk.job, progress.rank)
        elif marker_needed:
            orbax_protocol.write_restore_marker(disk.client_dir, disk.job, step, progress.rank)
        progress.restore_done = True
        meta.save_progress(progress)
        log.info("%s/%s rank %d: restore marker for step %s written (source %s)", disk.namespace, disk.job, progress.rank, step, source)

    async def _detect_commits(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        if progress.rank is None:
            return
        known = meta.manifests()
        # A thread lists the pod's dir only when it changed: the hop costs ten times the cached look.
        scan = orbax_protocol.cached_scan(disk.client_dir) or await asyncio.to_thread(orbax_protocol.scan_steps, disk.client_dir)
        for step in set(known) - set(scan.committed) - set(scan.staged):
            meta.drop_manifest(step)  # Orbax removed an old step itself
        refused = self._refused.setdefault((disk.namespace, disk.job), set())
        refused &= set(scan.committed) | set(scan.refused)  # a name reused later is looked at afresh
        for step in set(scan.refused) - refused:
            self._refuse(disk, meta, refused, step, "is not a directory (a symlink, FIFO or file where Orbax commits a step)")
        new = [s for s in scan.committed if s not in known and s not in refused]
        for step in new:
            step_dir = orbax_protocol.find_step_dir(disk.client_dir, step)
            try:
                manifest = await asyncio.to_thread(build_manifest, step_dir or os.path.join(disk.client_dir, str(step)), step, progress.rank,
                                                   self._share, len(meta.lineage()))  # fmt: skip
            except FileNotFoundError:
                continue  # Orbax deleted it meanwhile
            except (OSError, ValueError) as err:
                self._refuse(disk, meta, refused, step, f"cannot be checkpointed: {err}")
                continue
            if not orbax_protocol.has_commit_evidence(manifest.files):
                self._refuse(disk, meta, refused, step, f"lacks Orbax's {orbax_protocol.COMMIT_EVIDENCE}: not a complete checkpoint")
                continue
            meta.save_manifest(manifest)
            if (progress.rank, step) in meta.replicas():
                meta.drop_replica(progress.rank, step)  # a step set aside by a restore, written anew: superseded
            NEWEST_STEP.labels(disk.namespace, disk.job, str(progress.rank)).set(step)
            log.info("%s/%s rank %d: step %d committed (%d files, %d bytes)", disk.namespace, disk.job, progress.rank, step, len(manifest.files), manifest.total_bytes)
        if new:
            self.poke()

    def _refuse(self, disk: Ramdisk, meta: JobMeta, refused: set[int], step: int, why: str) -> None:
        """A committed step holding anything but regular files and directories is never
        checksummed, replicated, backed up or restored; the job is told once."""
        refused.add(step)
        REFUSED_STEPS.inc()
        message = f"step {step} {why}; it is not replicated or backed up"
        log.error("%s/%s: %s", disk.namespace, disk.job, message)
        report_to_job(meta, message)
