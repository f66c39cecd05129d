"""The node agent's share of the backup tier: upload the ranks it holds, list what is backed up,
and download a rank's step for a restore.

Uploads run in threads, off the training path; a failing store is retried with backoff (tenacity)
and reported (``replicator.errors``, metrics) while the ramdisk and peer tiers carry on.
"""

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping

import tenacity
from prometheus_client import Counter, Histogram

from replicator.backup_tier import shared_upload
from replicator.backup_tier.layout import RankManifest
from replicator.backup_tier.object_store import BackupError
from replicator.backup_tier.store import BackupStore
from replicator.backup_tier.transfers import RankUpload
from replicator.local_tier.in_flight import InFlight
from replicator.local_tier.job_keys import BusySteps
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import StepManifest
from replicator.pacing.cpu_share import CpuShare
from replicator.wire.messages import BackedUp, BackupOrder, JobRef, files_digest

log = logging.getLogger(__name__)

BACKUP_FAILURES = Counter("mtc_backup_failures_total", "Backup uploads or listings that failed")
BACKUP_SECONDS = Histogram("mtc_backup_upload_seconds", "Seconds to upload one rank's step")
BACKUP_BYTES = Counter(
    "mtc_backup_uploaded_bytes_total", "Bytes of step data this node uploaded (deduplicated files excluded)"
)
# A rank's step being uploaded: its bytes, and those stored so far (deduplicated files count at once).
BACKUP_IN_FLIGHT = InFlight("mtc_backup", "uploaded", "backups")

# The lister of a job lists its backups this often (30 list calls an hour); the node that writes a
# step's COMMIT lists at once, so the coordinator learns of new backups without waiting for it.
_LIST_INTERVAL_SECONDS = 120.0
# After a failed listing: a backup committed during a store outage is learnt of within this of the store's return,
# not a whole interval later (the coordinator chooses the next backup only once it knows the last one complete).
_LIST_RETRY_SECONDS = 10.0
_RETRY_WAIT = tenacity.wait_exponential(min=2, max=60)  # seconds between attempts: 2, 4, 8, ... 60


class BackupWorker:
    """Runs backup orders against one ``BackupStore``.

    Args:
      store: the backup tier (``--backup``).
      keep: complete backups to keep per job (``--backup-keep``).
      busy_steps: the steps being read; shared with garbage collection, which skips them.
      report_error: called with (the job's JobMeta, message) for errors the job should see.
      on_change: called when the listing of complete backups changed.
      share: the agent's CPU cap while jobs train (content identities), or None.
    """

    def __init__(
        self,
        store: BackupStore,
        keep: int,
        busy_steps: BusySteps,
        report_error: Callable[[JobMeta, str], None],
        on_change: Callable[[], None],
        share: CpuShare | None = None,
    ):
        self.store = store
        self._share = share
        self._keep = keep
        self._busy = busy_steps
        self._report_error = report_error
        self._on_change = on_change
        self.listing: dict[JobRef, BackedUp] = {}
        self._listed_at: dict[JobRef, float] = {}
        self._relist: dict[JobRef, str] = {}  # job -> ramdisk: committed here, not listed since (``_commit``)
        # The coordinator repeats a wanted order with every reply; one it stopped repeating for this
        # long (done, given up, or the coordinator is away) is not retried. Set from the heartbeat.
        self.order_ttl_seconds = 10.0
        # (job, rank) -> (ramdisk, order, asked at). A node uploads its own rank and, for a rank whose node was lost
        # mid-backup, the replica it holds or a reference to its own rank's upload (``coordinator.backups.stand_ins``):
        # one upload at a time per rank.
        self._wanted: dict[tuple[JobRef, int], tuple[str, BackupOrder, float]] = {}
        self._tasks: dict[tuple[JobRef, int], asyncio.Task] = {}
        self._uploaded: set[tuple] = set()  # the coordinator hears of it only from the next listing

    async def refresh(self, ramdisks: Mapping[JobRef, str], force: bool = False) -> None:
        """Lists complete backups of each job at most every ``_LIST_INTERVAL_SECONDS`` (``force``: now), and
        ``_LIST_RETRY_SECONDS`` after a failed listing; keeps the last listing on failure. A job this node committed
        a backup of is listed with them until a listing succeeds, lister or not (``_commit``).

        Args:
          ramdisks: job -> its ramdisk path on this node.
        """
        now = time.monotonic()
        for key, ramdisk_path in {**self._relist, **ramdisks}.items():
            if not force and now - self._listed_at.get(key, -_LIST_INTERVAL_SECONDS) < _LIST_INTERVAL_SECONDS:
                continue
            self._listed_at[key] = now
            try:
                steps = tuple(await asyncio.to_thread(self.store.complete_steps, key))
            except BackupError as err:
                BACKUP_FAILURES.inc()
                self._report_error(JobMeta(ramdisk_path), f"listing the backup tier failed, retrying: {err}")
                self._listed_at[key] = now - _LIST_INTERVAL_SECONDS + _LIST_RETRY_SECONDS
                continue
            self._relist.pop(key, None)
            self.listing[key] = BackedUp(key.namespace, key.job, steps, time.time())
            self._on_change()

    def start(self, ramdisk_path: str, order: BackupOrder) -> None:
        """Wants the upload ``order`` asks for: its rank's task runs it (now, or after the backoff of a
        failed attempt); a newer order of the same job and rank replaces it."""
        wanted = (JobRef(order.namespace, order.job), order.rank)
        self._wanted[wanted] = (ramdisk_path, order, time.monotonic())
        if wanted not in self._tasks or self._tasks[wanted].done():
            self._tasks[wanted] = asyncio.create_task(self._back_up(wanted))

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _back_up(self, wanted: tuple[JobRef, int]) -> None:
        """Runs the (job, rank)'s wanted order until it is done or no longer asked for. A failed attempt is
        reported and retried after an exponential backoff; each attempt takes the newest order."""
        retrying = tenacity.AsyncRetrying(
            wait=_RETRY_WAIT,
            retry=tenacity.retry_if_exception_type((BackupError, OSError)),
            before_sleep=lambda state: self._report_failure(wanted, state),
        )
        async for attempt in retrying:
            with attempt:
                ramdisk_path, order, asked = self._wanted[wanted]
                key = (order.namespace, order.job, order.step, order.timeline, order.rank, order.incarnation)
                if key in self._uploaded or time.monotonic() - asked > self.order_ttl_seconds:
                    return
                await self._upload(ramdisk_path, order, key)

    def _report_failure(self, wanted: tuple[JobRef, int], state: tenacity.RetryCallState) -> None:
        BACKUP_FAILURES.inc()
        ramdisk_path, order, _ = self._wanted[wanted]
        message = (
            f"backup of step {order.step} rank {order.rank} to the backup tier {self.store.url} failed "
            f"(retrying in {state.next_action.sleep:.0f} s): {state.outcome.exception()}"  # type: ignore[union-attr]
        )
        log.warning("%s: %s", wanted[0], message)
        self._report_error(JobMeta(ramdisk_path), message)

    async def _upload(self, ramdisk_path: str, order: BackupOrder, key: tuple) -> None:
        """Uploads the rank's step, commits it when every rank is there, and applies retention.

        Raises:
          BackupError, OSError: the store failed, or a local file could not be read.
        """
        if order.data_rank is not None:
            await self._stand_in(ramdisk_path, order, order.data_rank, key)
            return
        located = JobMeta(ramdisk_path).locate(order.rank, order.step)
        if located is None:
            return
        job = JobRef(order.namespace, order.job)
        started = time.monotonic()
        upload = RankUpload(
            job,
            order.step,
            order.rank,
            *located,
            incarnation=order.incarnation,
            share=self._share,
            timeline=order.timeline,
        )
        with self._busy.reading(job, order.step):
            if not await self._stored_already(upload):
                ready, dedup = await self._dedup_for(upload, order)
                if not ready:
                    return
                await self._store(dataclasses.replace(upload, dedup_from=dedup), started)
            await self._commit(ramdisk_path, order, job)
            self._uploaded.add(key)

    async def _stand_in(self, ramdisk_path: str, order: BackupOrder, data_rank: int, key: tuple) -> None:
        """Stores ``order.rank``'s manifest naming the objects of its data-parallel peer ``data_rank``'s upload
        of this backup (``shared_upload.reference``), then commits. Only when this node's copy of the peer's step has
        the rank's checksums (``order.data_digest``) and the peer's stored manifest is of that copy; until the peer's
        upload is stored, the next order retries.

        Raises:
          BackupError: the store failed.
        """
        job = JobRef(order.namespace, order.job)
        located = JobMeta(ramdisk_path).locate(data_rank, order.step)
        if located is None or order.data_digest is None or files_digest(located[1].files) != order.data_digest:
            log.warning(
                "%s: not standing in for rank %d with rank %d's step %d: this node's copy is not in its checksums",
                job,
                order.rank,
                data_rank,
                order.step,
            )
            return
        source = await asyncio.to_thread(self.store.rank_manifest, job, order.step, data_rank, order.timeline)
        if source is None or source.incarnation != order.incarnation:
            return  # the peer's upload of this backup is not stored yet
        if source.step_manifest().files != located[1].files:
            raise BackupError(f"rank {data_rank}'s stored manifest of step {order.step} is not this node's copy")
        await asyncio.to_thread(shared_upload.reference, self.store, job, order.rank, source)
        log.info(
            "%s: rank %d step %d backed up to %s as a reference to rank %d's upload (its node was lost)",
            job,
            order.rank,
            order.step,
            self.store.url,
            data_rank,
        )
        await self._commit(ramdisk_path, order, job)
        self._uploaded.add(key)

    async def _dedup_for(self, upload: RankUpload, order: BackupOrder) -> tuple[bool, RankManifest | None]:
        """Whether the rank's upload may go ahead now, and the stored files it deduplicates against: the union of
        its identical group's shares (``shared_upload``), the group's uploader's manifest, or None (upload all).
        Not ready while the group's shares or its uploader's manifest are not stored: the next order retries."""
        if order.share_group:
            dedup = await asyncio.to_thread(shared_upload.group_dedup, self.store, upload, order.share_group)
            return dedup is not None, dedup  # None: this rank's share is stored, the others' are not yet
        if order.dedup_from_rank is not None:
            dedup = await asyncio.to_thread(
                self.store.rank_manifest, upload.job, order.step, order.dedup_from_rank, order.timeline
            )
            return dedup is not None and dedup.incarnation == order.incarnation, dedup
        return True, None

    async def _store(self, upload: RankUpload, started: float) -> None:
        """Uploads the rank's step (``BackupStore.upload_rank``), counted in flight and in the metrics; ``started``:
        when the order's attempt began (monotonic seconds)."""
        total = upload.manifest.total_bytes
        with BACKUP_IN_FLIGHT.transfer(upload.job.namespace, upload.job.job, total) as sent:
            stored = await asyncio.to_thread(self.store.upload_rank, dataclasses.replace(upload, on_file=sent))
        uploaded = sum(f.size for f in stored.files.values() if f.object.startswith(f"rank-{upload.rank}/"))
        BACKUP_BYTES.inc(uploaded)
        BACKUP_SECONDS.observe(time.monotonic() - started)
        log.info(
            "%s: rank %d step %d backed up to %s (%d of %d bytes uploaded, %.2f s)",
            upload.job,
            upload.rank,
            upload.step,
            self.store.url,
            uploaded,
            total,
            time.monotonic() - started,
        )

    async def _stored_already(self, upload: RankUpload) -> bool:
        """Whether the rank's step is stored for this backup (its tag) with these bytes: uploaded by this node before
        the agent restarted, or by the rank's node before it was replaced; only the commit may be left to do."""
        done = await asyncio.to_thread(self.store.rank_manifest, upload.job, upload.step, upload.rank, upload.timeline)
        return (
            done is not None
            and done.incarnation == upload.incarnation
            and done.step_manifest().files == upload.manifest.files
        )

    async def _commit(self, ramdisk_path: str, order: BackupOrder, job: JobRef) -> None:
        """Commits the step once every rank is stored, then applies retention and lists the job's backups anew (again
        with the loop's next listings while that fails, ``refresh``)."""
        if await asyncio.to_thread(
            self.store.commit_if_complete, job, order.step, order.nodes, order.incarnation, order.timeline
        ):
            deleted = await asyncio.to_thread(self.store.retain, job, self._keep, order.protected, order.forks)
            log.info("%s: backup of step %d complete; retention deleted %s", job, order.step, deleted or "nothing")
            self._relist[job] = ramdisk_path  # until a listing shows it: a store outage may fail this one
            await self.refresh({job: ramdisk_path}, force=True)

    async def download(
        self,
        meta: JobMeta,
        job: JobRef,
        step: int,
        rank: int,
        timeline: int = 0,
        on_range: Callable[[int], None] | None = None,
    ) -> tuple[str, StepManifest]:
        """Downloads and verifies ``rank``'s ``step`` of ``timeline`` into the ramdisk's incoming area;
        ``on_range`` is called with each range's bytes as it lands.

        Returns:
          The verified directory (rename it into place) and its manifest.

        Raises:
          BackupError: missing, incomplete or corrupt backup, or the store failed.
          OSError: the ramdisk is full.
        """
        incoming = meta.new_incoming_dir()
        dest = os.path.join(incoming, "step")
        try:
            manifest = await asyncio.to_thread(
                self.store.download_rank, job, step, rank, dest, timeline=timeline, on_range=on_range
            )
        except (BackupError, OSError):
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        return dest, manifest
