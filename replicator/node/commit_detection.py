"""Commit detection: finds the steps Orbax committed in a pod's client dir and checksums them.

A new ``<step>/`` gets a ``StepManifest`` (the node then reports, replicates and backs it up); a step
Orbax removed loses its manifest; a step holding anything but regular files and directories, or
lacking Orbax's commit evidence, is refused once and the job is told.
"""

import asyncio
import logging
import os
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from csi_driver.ramdisk import Ramdisk
from prefetch import resharded
from replicator.local_tier.job_keys import job_of
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import report_to_job
from replicator.local_tier.step_manifest import build_manifest
from replicator.pacing.cpu_share import CpuShare
from replicator.wire.messages import JobRef
from replicator.wire.metric_labels import JOB_LABELS

log = logging.getLogger(__name__)

NEWEST_STEP = Gauge("mtc_newest_committed_step", "Newest committed local step", [*JOB_LABELS, "rank"])
REFUSED_STEPS = Counter(
    "mtc_refused_steps_total",
    "Committed steps refused: they hold a symlink, FIFO, device or socket, or cannot be walked",
)


class CommitDetector:
    """Checksums newly committed steps of every job on the node.

    Args:
      share: the CPU cap of checksumming while jobs train, or None.
      poke: called when a step was committed: the node reports at once.
    """

    def __init__(self, share: CpuShare | None, poke: Callable[[], None]):
        self._share = share
        self._poke = poke
        self._refused: dict[JobRef, set[int]] = {}  # steps never to checksum again, per job

    async def detect(self, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        """One look at the pod's client dir: manifests for new steps, dropped ones for removed steps."""
        if progress.rank is None:
            return
        known, framework = meta.manifests(), meta.framework
        # A thread lists the pod's dir only when it changed: the hop costs ten times the cached look.
        scan = framework.cached_scan(disk.client_dir)
        if scan is None:
            scan = await asyncio.to_thread(framework.scan_steps, disk.client_dir)
        for step in set(known) - set(scan.committed) - set(scan.staged):
            meta.drop_manifest(step)  # Orbax removed an old step itself
        refused = self._refused.setdefault(job_of(disk), set())
        refused &= set(scan.committed) | set(scan.refused)  # a name reused later is looked at afresh
        for step in set(scan.refused) - refused:
            self._refuse(
                disk, meta, refused, step, "is not a directory (a symlink, FIFO or file where the job commits a step)"
            )
        new = [s for s in scan.committed if s not in known and s not in refused]
        for step in new:
            step_dir = framework.find_step_dir(disk.client_dir, step)
            try:
                manifest = await asyncio.to_thread(
                    build_manifest,
                    step_dir or os.path.join(disk.client_dir, str(step)),
                    step,
                    progress.rank,
                    self._share,
                    len(meta.lineage()),
                )
            except FileNotFoundError:
                continue  # Orbax deleted it meanwhile
            except (OSError, ValueError) as err:
                self._refuse(disk, meta, refused, step, f"cannot be checkpointed: {err}")
                continue
            if missing := framework.missing_commit_evidence(manifest.files):
                self._refuse(disk, meta, refused, step, f"lacks {missing}: not a complete checkpoint")
                continue
            meta.save_manifest(manifest)
            if (progress.rank, step) in meta.replicas():
                meta.drop_replica(progress.rank, step)  # a step set aside by a restore, written anew: superseded
            NEWEST_STEP.labels(disk.namespace, disk.job, str(progress.rank)).set(step)
            log.info(
                "%s/%s rank %d: step %d committed (%d files, %d bytes)",
                disk.namespace,
                disk.job,
                progress.rank,
                step,
                len(manifest.files),
                manifest.total_bytes,
            )
        if new:
            # The job trains on past an elastic restore: it loaded the old nodes' copies staged for it.
            await asyncio.to_thread(resharded.drop_resharded, disk.client_dir, lambda step: step >= max(new))
            self._poke()

    def _refuse(self, disk: Ramdisk, meta: JobMeta, refused: set[int], step: int, why: str) -> None:
        """A committed step holding anything but regular files and directories is never
        checksummed, replicated, backed up or restored; the job is told once."""
        refused.add(step)
        REFUSED_STEPS.inc()
        message = f"step {step} {why}; it is not replicated or backed up"
        log.error("%s/%s: %s", disk.namespace, disk.job, message)
        report_to_job(meta, message)
