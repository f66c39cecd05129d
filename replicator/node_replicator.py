"""The node agent's side of the Orbax protocol, for every job ramdisk on the node.

- Reports the node's pods and committed steps to the coordinator, on every change and as a heartbeat.
- Writes ``jax-init-info.txt`` once the coordinator assigns the pod a rank.
- Validates and consumes ``replicator.yaml``; bad content goes to ``replicator.failed``.
- Detects committed steps and checksums them.
- Runs the restore: stage and verify the agreed step, wait until every rank has, then write the marker.
"""

import asyncio
import contextlib
import logging
import os
import time

import aiohttp
from prometheus_client import Counter, Gauge, Histogram

from csi_driver.ramdisk import Ramdisk, RamdiskManager
from prefetch import staging
from replicator import orbax_protocol
from replicator.job_meta import JobMeta, PodProgress
from replicator.messages import Assignment, HeldStep, JobSettings, NodeReport, PodReport, RestoreView, to_json
from replicator.step_manifest import build_manifest

log = logging.getLogger(__name__)

NEWEST_STEP = Gauge("mtc_newest_committed_step", "Newest committed local step", ["namespace", "job", "rank"])
RESTORE_SECONDS = Histogram("mtc_restore_seconds", "Seconds from replicator.yaml consumed to restore marker written", ["source"])
REPLICATOR_YAML = Counter("mtc_replicator_yaml_total", "replicator.yaml files consumed", ["result"])
CORRUPT_COPIES = Counter("mtc_corrupt_copies_total", "Step copies that failed checksum verification")

_REPORT_INTERVAL_SECONDS = 1.0
_WATCH_INTERVAL_SECONDS = 0.2
_RESTORE_DEADLINE_SECONDS = 270.0  # Orbax waits 300 s for the marker
_ERROR_REPEAT_SECONDS = 30.0


class CoordinatorUnavailable(Exception):
    """The coordinator could not be reached or refused the request."""


class CoordinatorClient:
    """The node agent's HTTP client of the coordinator."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self._session = session
        self._base = base_url.rstrip("/")

    async def _call(self, method: str, path: str, **kwargs) -> dict:
        try:
            async with self._session.request(method, self._base + path, **kwargs) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise CoordinatorUnavailable(f"{method} {path}: HTTP {response.status}: {body.get('error', body)}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            raise CoordinatorUnavailable(f"{method} {path}: {err!r}") from None

    async def report(self, report: NodeReport) -> list[Assignment]:
        body = await self._call("POST", "/v1/report", json=to_json(report))
        return [Assignment.from_json(a) for a in body["assignments"]]

    async def record_settings(self, disk: Ramdisk, progress: PodProgress, settings: JobSettings) -> None:
        payload = {"incarnation": progress.incarnation, "rank": progress.rank, "settings": to_json(settings)}
        await self._call("POST", f"/v1/jobs/{disk.namespace}/{disk.job}/settings", json=payload)

    async def restore_view(self, disk: Ramdisk, progress: PodProgress) -> RestoreView:
        params = {"incarnation": progress.incarnation, "rank": str(progress.rank)}
        return RestoreView.from_json(await self._call("GET", f"/v1/jobs/{disk.namespace}/{disk.job}/restore", params=params))

    async def report_staged(self, disk: Ramdisk, progress: PodProgress, generation: str, bad: list) -> None:
        payload = {"incarnation": progress.incarnation, "generation": generation, "rank": progress.rank, "bad": bad}
        await self._call("POST", f"/v1/jobs/{disk.namespace}/{disk.job}/restore", json=payload)


def current_pod(disk: Ramdisk):
    """The newest publication of the ramdisk: the job's pod on this node (one per node)."""
    return max(disk.publications.values(), key=lambda p: p.published_at).spec if disk.publications else None


class NodeReplicator:
    """Drives the Orbax protocol for every ramdisk of the node.

    Args:
      node_id, url, pod_address, topology: what the node reports about itself.
      manager: the node's ramdisks.
      coordinator_url: the coordinator's base URL.
    """

    def __init__(self, node_id: str, url: str, pod_address: str | None, topology: dict[str, str], manager: RamdiskManager, coordinator_url: str):
        self.node_id = node_id
        self._url = url
        self._pod_address = pod_address
        self._topology = topology
        self._manager = manager
        self._coordinator_url = coordinator_url
        self._assignments: dict[str, Assignment] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: dict[tuple[str, str], asyncio.Task] = {}
        self._last_error: dict[str, float] = {}

    def poke(self) -> None:
        """Asks for a report now; safe to call from any thread (the gRPC servicer's)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self, stop: asyncio.Event) -> None:
        """Reports and watches until ``stop`` is set."""
        self._loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            client = CoordinatorClient(session, self._coordinator_url)
            try:
                while not stop.is_set():
                    self._wake.clear()
                    disks = await asyncio.to_thread(self._manager.ramdisks)
                    await self._report(client, disks)
                    self._sync_workers(client, disks)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), _REPORT_INTERVAL_SECONDS)
            finally:
                for task in self._workers.values():
                    task.cancel()
                await asyncio.gather(*self._workers.values(), return_exceptions=True)

    # -- reporting -----------------------------------------------------------------------------

    async def _report(self, client: CoordinatorClient, disks: dict) -> None:
        report = await asyncio.to_thread(self._build_report, disks)
        try:
            assignments = await client.report(report)
        except CoordinatorUnavailable as err:
            self._log_once("report", f"coordinator unreachable, retrying: {err}")
            return
        self._assignments = {a.pod_uid: a for a in assignments}

    def _build_report(self, disks: dict) -> NodeReport:
        pods, held = [], []
        for disk in disks.values():
            meta = JobMeta(disk.path)
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
            present = set(orbax_protocol.held_steps(disk.client_dir))
            for step, manifest in meta.manifests().items():
                if step in present:
                    held.append(HeldStep(disk.namespace, disk.job, step, manifest.rank, manifest.files))
        return NodeReport(self.node_id, self._url, self._pod_address, self._topology, tuple(pods), tuple(held))

    def _log_once(self, key: str, message: str, local_dir: str | None = None) -> None:
        """Logs (and reports to ``replicator.errors``) at most every 30 s per key."""
        now = time.monotonic()
        if now - self._last_error.get(key, -_ERROR_REPEAT_SECONDS) >= _ERROR_REPEAT_SECONDS:
            self._last_error[key] = now
            log.warning("%s", message)
            if local_dir is not None:
                orbax_protocol.report_error(local_dir, message)

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
        while True:
            disk = (await asyncio.to_thread(self._manager.ramdisks)).get(key)
            spec = current_pod(disk) if disk else None
            if spec is None:
                return
            meta = JobMeta(disk.path)
            progress = meta.progress(spec.pod_uid)
            self._apply_assignment(disk, meta, progress)
            if progress.jax_init_written and progress.settings is None:
                await self._consume_replicator_yaml(client, disk, meta, progress, spec.nodes or 1)
            if progress.settings is not None and not progress.restore_done:
                await self._restore(client, disk, meta, progress)
            await self._detect_commits(disk, meta, progress)
            await asyncio.sleep(_WATCH_INTERVAL_SECONDS)

    def _apply_assignment(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        assignment = self._assignments.get(progress.pod_uid)
        if assignment is None or assignment.incarnation == progress.incarnation:
            return
        progress.__init__(progress.pod_uid, assignment.incarnation, assignment.rank, assignment.jax_coordinator)
        orbax_protocol.write_jax_init_info(disk.client_dir, assignment.rank, assignment.jax_coordinator)
        progress.jax_init_written = True
        meta.save_progress(progress)
        log.info("%s/%s: pod %s is rank %d of incarnation %s (JAX coordinator %s)",
                 disk.namespace, disk.job, progress.pod_uid, assignment.rank, assignment.incarnation, assignment.jax_coordinator)  # fmt: skip

    async def _consume_replicator_yaml(self, client, disk: Ramdisk, meta: JobMeta, progress: PodProgress, nodes: int) -> None:
        path = os.path.join(disk.client_dir, orbax_protocol.REPLICATOR_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return
        try:
            config = orbax_protocol.parse_replicator_config(text, progress.rank, nodes)
        except orbax_protocol.InvalidReplicatorConfig as err:
            log.error("%s/%s: rejected replicator.yaml: %s", disk.namespace, disk.job, err)
            orbax_protocol.report_failure(disk.client_dir, str(err))
            os.unlink(path)  # Orbax reads replicator.failed only once the yaml is gone
            REPLICATOR_YAML.labels("rejected").inc()
            return
        settings = JobSettings(config.peer_ranks, config.data_parallelism, config.backup_interval_minutes, config.backup_interval_steps)
        try:
            await client.record_settings(disk, progress, settings)
        except CoordinatorUnavailable as err:
            self._log_once(f"settings-{disk.job}", f"cannot record job settings with the coordinator, retrying: {err}", disk.client_dir)
            return
        progress.settings = settings
        meta.save_progress(progress)
        os.unlink(path)
        REPLICATOR_YAML.labels("accepted").inc()
        log.info("%s/%s rank %d: consumed replicator.yaml %s", disk.namespace, disk.job, progress.rank, settings)

    async def _restore(self, client, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        started = time.monotonic()
        staged_generation = None
        while time.monotonic() - started < _RESTORE_DEADLINE_SECONDS:
            try:
                view = await client.restore_view(disk, progress)
                if view.step is not None and view.generation != staged_generation:
                    bad = await asyncio.to_thread(self._stage, disk, meta, view)
                    await client.report_staged(disk, progress, view.generation, bad)
                    staged_generation = view.generation
                    continue
            except CoordinatorUnavailable as err:
                self._log_once(f"restore-{disk.job}", f"restore plan unavailable, retrying: {err}", disk.client_dir)
                await asyncio.sleep(1.0)
                continue
            if view.ready:
                source = await asyncio.to_thread(self._hand_over, disk, meta, progress, view)
                RESTORE_SECONDS.labels(source).observe(time.monotonic() - started)
                return
            await asyncio.sleep(_WATCH_INTERVAL_SECONDS)
        orbax_protocol.report_error(disk.client_dir, f"restore did not complete within {_RESTORE_DEADLINE_SECONDS:.0f} s")

    def _stage(self, disk: Ramdisk, meta: JobMeta, view: RestoreView) -> list[tuple[int, int, str]]:
        """Stages the view's step from its first verified source; returns the copies that failed."""
        bad = []
        for source in view.sources:
            if source["holder"] == self.node_id:
                problems = staging.stage_local(disk.client_dir, view.step, meta.manifests().get(view.step))
            else:
                problems = [f"tier {source['tier']} is not available on this node"]
            if not problems:
                return []
            CORRUPT_COPIES.inc()
            message = f"step {view.step} copy on {source['holder']} unusable: {'; '.join(problems[:3])}"
            orbax_protocol.report_error(disk.client_dir, message)
            bad.append((view.step, source["data_rank"], source["holder"]))
        return bad

    def _hand_over(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress, view: RestoreView) -> str:
        for step in staging.clear_for_restore(disk.client_dir, view.step):
            meta.drop_manifest(step)
        if view.step is None:
            orbax_protocol.write_fresh_start_marker(disk.client_dir, disk.job, progress.rank)
            source = "none"
        else:
            orbax_protocol.write_restore_marker(disk.client_dir, disk.job, view.step, progress.rank)
            source = view.sources[0]["tier"]
        progress.restore_done = True
        meta.save_progress(progress)
        log.info("%s/%s rank %d: restore marker for step %s written (source %s)", disk.namespace, disk.job, progress.rank, view.step, source)
        return source

    async def _detect_commits(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        if progress.rank is None:
            return
        known = meta.manifests()
        for step in set(known) - set(orbax_protocol.held_steps(disk.client_dir)):
            meta.drop_manifest(step)  # Orbax removed an old step itself
        new = [s for s in orbax_protocol.committed_steps(disk.client_dir) if s not in known]
        for step in new:
            manifest = await asyncio.to_thread(build_manifest, os.path.join(disk.client_dir, str(step)), step, progress.rank)
            meta.save_manifest(manifest)
            NEWEST_STEP.labels(disk.namespace, disk.job, str(progress.rank)).set(step)
            log.info("%s/%s rank %d: step %d committed (%d files, %d bytes)", disk.namespace, disk.job, progress.rank, step, len(manifest.files), manifest.total_bytes)
        if new:
            self.poke()
