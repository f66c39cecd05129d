"""How soon a node's listing of complete backups follows a store outage (``BackupWorker.refresh``): against a real
fake-gcs-server whose bucket is missing, then made. The coordinator chooses a job's next backup only once a listing
shows the last one complete, so a listing that failed is retried within seconds, not a whole listing interval
later (found by the grants chaos run: a backup committed as a 503 outage began was learnt of 97 s late, after the
outage, and the job's RPO went past its bound)."""

import asyncio

from replicator.backup_tier import worker
from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.worker import BackupWorker
from replicator.local_tier.job_keys import BusySteps
from replicator.wire.messages import JobRef

JOB = JobRef("default", "listed")


def test_a_failed_listing_is_retried_after_the_retry_wait_not_the_listing_interval(fake_gcs, tmp_path, monkeypatch):
    monkeypatch.setattr(worker, "_LIST_RETRY_SECONDS", 0.5)  # 10 s in the product; the interval stays 120 s
    errors: list[str] = []
    backups = BackupWorker(
        open_backup_store("gs://later/mtc", emulator_host=fake_gcs.url),
        3,
        BusySteps(),
        lambda meta, message: errors.append(message),
        lambda: None,
    )
    ramdisks = {JOB: str(tmp_path)}

    async def run() -> None:
        await backups.refresh(ramdisks)  # the bucket is missing: as a store that answers 503
        assert len(errors) == 1 and errors[0].startswith("listing the backup tier failed, retrying: "), errors
        assert JOB not in backups.listing
        fake_gcs.client().create_bucket("later")
        await backups.refresh(ramdisks)  # not due yet
        assert JOB not in backups.listing and len(errors) == 1
        await asyncio.sleep(0.6)
        await backups.refresh(ramdisks)
        assert backups.listing[JOB].steps == () and len(errors) == 1
        await backups.refresh(ramdisks)  # listed: the next one is a whole interval away
        assert len(errors) == 1

    asyncio.run(run())
