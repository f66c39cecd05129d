"""The node agent's share of the backup tier: upload the ranks it holds, list what is backed up,
and download a rank's step for a restore.

Uploads run in threads, off the training path; a failing store is retried with backoff and
reported (``replicator.errors``, metrics) while the ramdisk and peer tiers carry on.
"""

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram

from replicator.backup_store import BackupError, BackupStore
from replicator.job_meta import JobMeta
from replicator.messages import BackupOrder
from replicator.step_manifest import StepManifest

log = logging.getLogger(__name__)

BACKUP_FAILURES = Counter("mtc_backup_failures_total", "Backup uploads or listings that failed")
BACKUP_SECONDS = Histogram("mtc_backup_upload_seconds", "Seconds to upload one rank's step")
BACKUP_BYTES = Counter("mtc_backup_uploaded_bytes_total", "Bytes of step data this node uploaded (deduplicated files excluded)")

_LIST_INTERVAL_SECONDS = 5.0
_MAX_BACKOFF_SECONDS = 60.0


@dataclasses.dataclass
class _Backoff:
    failures: int = 0
    not_before: float = 0.0


class BackupWorker:
    """Runs backup orders against one ``BackupStore``.

    Args:
      store: the backup tier (``--backup``).
      keep: complete backups to keep per job (``--backup-keep``).
      busy_steps: (namespace, job, step) being read; shared with garbage collection, which skips them.
      report_error: called with (the job's JobMeta, message) for errors the job should see.
      on_change: called when the listing of complete backups changed.
    """

    def __init__(self, store: BackupStore, keep: int, busy_steps: set, report_error: Callable[[JobMeta, str], None], on_change: Callable[[], None]):
        self.store = store
        self._keep = keep
        self._busy = busy_steps
        self._report_error = report_error
        self._on_change = on_change
        self.listing: dict[tuple[str, str], tuple[int, ...]] = {}
        self._listed_at: dict[tuple[str, str], float] = {}
        self._uploads: dict[tuple, asyncio.Task] = {}
        self._uploaded: set[tuple] = set()  # the coordinator hears of it only from the next listing
        self._backoff: dict[tuple[str, str], _Backoff] = {}

    async def refresh(self, ramdisks: dict[tuple[str, str], str], force: bool = False) -> None:
        """Lists complete backups of each job at most every 5 s; keeps the last listing on failure.

        Args:
          ramdisks: (namespace, job) -> the job's ramdisk path on this node.
        """
        now = time.monotonic()
        for key, ramdisk_path in ramdisks.items():
            if not force and now - self._listed_at.get(key, -_LIST_INTERVAL_SECONDS) < _LIST_INTERVAL_SECONDS:
                continue
            self._listed_at[key] = now
            try:
                steps = tuple(await asyncio.to_thread(self.store.complete_steps, f"{key[0]}/{key[1]}"))
            except BackupError as err:
                BACKUP_FAILURES.inc()
                self._report_error(JobMeta(ramdisk_path), f"listing the backup tier failed, retrying: {err}")
                continue
            if steps != self.listing.get(key):
                self.listing[key] = steps
                self._on_change()

    def start(self, ramdisk_path: str, order: BackupOrder) -> None:
        """Starts the upload ``order`` asks for, unless it runs already or its job is backing off."""
        key = (order.namespace, order.job, order.step, order.rank, order.incarnation)
        backoff = self._backoff.get(key[:2], _Backoff())
        self._uploads = {k: t for k, t in self._uploads.items() if not t.done()}
        if key in self._uploads or key in self._uploaded or time.monotonic() < backoff.not_before:
            return
        self._uploads[key] = asyncio.create_task(self._upload(ramdisk_path, order, key))

    async def stop(self) -> None:
        for task in self._uploads.values():
            task.cancel()
        await asyncio.gather(*self._uploads.values(), return_exceptions=True)

    async def _upload(self, ramdisk_path: str, order: BackupOrder, key: tuple) -> None:
        meta = JobMeta(ramdisk_path)
        located = meta.locate(order.rank, order.step)
        if located is None:
            return
        job_key = f"{order.namespace}/{order.job}"
        busy = (order.namespace, order.job, order.step)
        self._busy.add(busy)
        started = time.monotonic()
        try:
            dedup = None
            if order.dedup_from_rank is not None:
                dedup = await asyncio.to_thread(self.store.rank_manifest, job_key, order.step, order.dedup_from_rank)
                if dedup is None or dedup.incarnation != order.incarnation:
                    return  # the group's uploader has not finished; the next order retries
            step_dir, manifest = located
            stored = await asyncio.to_thread(
                self.store.upload_rank, job_key, order.step, order.rank, step_dir, manifest, dedup, order.incarnation
            )
            uploaded = sum(f.size for f in stored.files.values() if f.object.startswith(f"rank-{order.rank}/"))
            BACKUP_BYTES.inc(uploaded)
            BACKUP_SECONDS.observe(time.monotonic() - started)
            log.info("%s: rank %d step %d backed up to %s (%d of %d bytes uploaded, %.2f s)", job_key, order.rank,
                     order.step, self.store.url, uploaded, manifest.total_bytes, time.monotonic() - started)  # fmt: skip
            if await asyncio.to_thread(self.store.commit_if_complete, job_key, order.step, order.nodes, order.incarnation):
                deleted = await asyncio.to_thread(self.store.retain, job_key, self._keep, order.protected)
                log.info("%s: backup of step %d complete; retention deleted %s", job_key, order.step, deleted or "nothing")
                await self.refresh({(order.namespace, order.job): ramdisk_path}, force=True)
            self._uploaded.add(key)
            self._backoff.pop((order.namespace, order.job), None)
        except (BackupError, OSError) as err:
            BACKUP_FAILURES.inc()
            backoff = self._backoff.setdefault((order.namespace, order.job), _Backoff())
            backoff.failures += 1
            delay = min(_MAX_BACKOFF_SECONDS, 2.0**backoff.failures)
            backoff.not_before = time.monotonic() + delay
            message = f"backup of step {order.step} rank {order.rank} to the backup tier {self.store.url} failed (retrying in {delay:.0f} s): {err}"
            log.warning("%s: %s", job_key, message)
            self._report_error(meta, message)
        finally:
            self._busy.discard(busy)

    async def download(self, meta: JobMeta, namespace: str, job: str, step: int, rank: int) -> tuple[str, StepManifest]:
        """Downloads and verifies ``rank``'s ``step`` into the ramdisk's incoming area.

        Returns:
          The verified directory (rename it into place) and its manifest.

        Raises:
          BackupError: missing, incomplete or corrupt backup, or the store failed.
          OSError: the ramdisk is full.
        """
        incoming = meta.new_incoming_dir()
        dest = os.path.join(incoming, "step")
        try:
            manifest = await asyncio.to_thread(self.store.download_rank, f"{namespace}/{job}", step, rank, dest)
        except (BackupError, OSError):
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        return dest, manifest
