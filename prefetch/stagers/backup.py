"""A copy downloaded from the backup tier (``BackupWorker.download``)."""

import os
import shutil
from collections.abc import Awaitable, Callable
from typing import ClassVar

from prefetch.stagers.base import Fetched, StageContext, Unreachable, check_owner, install
from replicator.backup_tier.object_store import BackupError
from replicator.local_tier.job_keys import job_of
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import CorruptCopy, StepManifest, UnusableCopy
from replicator.wire.messages import JobRef, Source, Tier

# (meta, job, step, data rank, timeline, called with each range's bytes as it lands) ->
# (verified step dir on the ramdisk, its manifest); raises BackupError or OSError. ``BackupWorker.download``.
BackupDownload = Callable[[JobMeta, JobRef, int, int, int, Callable[[int], None]], Awaitable[tuple[str, StepManifest]]]


class BackupStager:
    """Downloads the view's step from the backup tier into the ramdisk, verified, then stages it."""

    fetches: ClassVar[bool] = True

    def __init__(self, download: BackupDownload | None):
        self._download = download

    def serves(self, ctx: StageContext, source: Source) -> bool:
        return source.tier == Tier.BACKUP

    async def stage(self, ctx: StageContext, source: Source, fetched: Fetched) -> None:
        if self._download is None:
            raise UnusableCopy("no backup tier on this node (--backup)")
        try:
            verified, manifest = await self._download(
                ctx.meta, job_of(ctx.disk), ctx.step, source.data_rank, source.timeline, fetched
            )
        except UnusableCopy:
            raise
        except (BackupError, OSError) as err:
            raise Unreachable(str(err) or repr(err)) from err
        try:
            check_owner(manifest, source)
        except CorruptCopy:
            shutil.rmtree(os.path.dirname(verified), ignore_errors=True)
            raise
        await install(ctx, verified, manifest)
        if ctx.part is not None:  # the download's own directory, left empty by the move
            shutil.rmtree(os.path.dirname(verified), ignore_errors=True)
