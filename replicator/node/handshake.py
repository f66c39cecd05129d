"""The pod's start-up hand-shake through its framework's files: the rank file once the pod has a rank
(Orbax's ``jax-init-info.txt``), then ``replicator.yaml`` validated, recorded with the coordinator and
consumed (or refused through ``replicator.failed``). The file formats are the job's ``Framework``'s."""

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from csi_driver.file_cache import Key
from csi_driver.ramdisk import Ramdisk
from replicator.local_tier import pod_files
from replicator.local_tier.frameworks import Framework, InvalidReplicatorConfig
from replicator.local_tier.job_keys import job_of
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import LogOnce
from replicator.pacing import timing
from replicator.wire.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from replicator.wire.messages import Assignment, JobRef, JobSettings

log = logging.getLogger(__name__)

REPLICATOR_YAML = Counter("mtc_replicator_yaml_total", "replicator.yaml files consumed", ["result"])


class UnsettledConfigs:
    """Unusable config files not refused yet: one is refused only once it has stayed unchanged
    (its ``ConfigFile.version``) for ``settle_seconds`` since it was first read so.

    The Resiliency library writes ``replicator.yaml`` in place (``open("w")``, then ``yaml.dump``),
    so a pass may read it empty; Orbax and ``mtc_torch`` replace it whole, and a file that validates
    on its first read is taken at once. A stability check, not inotify's close-after-write: it needs
    no watch per job, holds for a file written before the agent (re)started looking, and bounds a
    writer that never closes, which a close event alone would wait for forever.

    Args:
      settle_seconds: how long an unusable file must stay unchanged before it is refused.
      clock: monotonic seconds.
    """

    def __init__(
        self, settle_seconds: float = timing.CONFIG_SETTLE_SECONDS, clock: Callable[[], float] = time.monotonic
    ):
        self.settle_seconds = settle_seconds
        self._clock = clock
        self._first_read: dict[JobRef, tuple[Key, float]] = {}  # job -> (its file's version, when first read unusable)

    def settled(self, job: JobRef, version: Key) -> bool:
        """True once ``job``'s unusable file, at ``version``, has been unchanged for ``settle_seconds``;
        a new version starts the wait again."""
        now = self._clock()
        if (seen := self._first_read.get(job)) is None or seen[0] != version:
            self._first_read[job] = seen = (version, now)
        return now - seen[1] >= self.settle_seconds

    def forget(self, job: JobRef) -> None:
        """Drops ``job``'s wait: its file was taken, refused or is gone."""
        self._first_read.pop(job, None)


def current_pod(disk: Ramdisk):
    """The newest publication of the ramdisk: the job's pod on this node (one per node)."""
    return max(disk.publications.values(), key=lambda p: p.published_at).spec if disk.publications else None


def apply_assignment(disk: Ramdisk, meta: JobMeta, progress: PodProgress, assignment: Assignment | None) -> PodProgress:
    """Writes ``jax-init-info.txt`` for a new assignment (None: the coordinator gave the pod none);
    returns the pod's progress after it."""
    if assignment is None or assignment.incarnation == progress.incarnation:
        return progress
    meta.framework.write_init_info(disk.client_dir, assignment.rank, assignment.jax_coordinator)
    progress = PodProgress(
        progress.pod_uid, assignment.incarnation, assignment.rank, assignment.jax_coordinator, jax_init_written=True
    )
    meta.save_progress(progress)
    log.info(
        "%s/%s: pod %s is rank %d of incarnation %s (JAX coordinator %s)",
        disk.namespace,
        disk.job,
        progress.pod_uid,
        assignment.rank,
        assignment.incarnation,
        assignment.jax_coordinator,
    )
    return progress


async def consume_replicator_yaml(
    client: CoordinatorClient,
    disk: Ramdisk,
    meta: JobMeta,
    progress: PodProgress,
    nodes: int,
    log_once: LogOnce,
    unsettled: UnsettledConfigs,
) -> None:
    """Validates the job's ``replicator.yaml`` (if written yet), records its settings with the
    coordinator and in ``progress``, then consumes it. Bad content goes to ``replicator.failed`` once
    ``unsettled`` says it is no half-written file; a file that is no regular file, or whose text so
    far is refused whatever follows (``InvalidReplicatorConfig.final``: an anchor, an alias, deep
    nesting), at once. The parse runs on a worker thread: a slow file never holds up the event loop
    (reports, peer serving, the HTTP side). An unreachable coordinator leaves the file for the next pass."""
    framework, job = meta.framework, job_of(disk)
    try:
        found = framework.read_config(disk.client_dir)
        if found is None:
            unsettled.forget(job)
            return
        settings = await asyncio.to_thread(_parse, framework, found.data, progress.rank, nodes)  # type: ignore[arg-type]  # called once the pod has its rank
    except pod_files.UnsafeEntry as err:
        _refuse(disk, meta, f"replicator.yaml is unusable: {err}")
        unsettled.forget(job)
        return
    except (InvalidReplicatorConfig, UnicodeDecodeError) as err:
        final = isinstance(err, InvalidReplicatorConfig) and err.final
        if not final and not unsettled.settled(job, found.version):  # type: ignore[union-attr]  # raised after read_config found the file
            return  # perhaps still being written: read again next pass
        what = str(err) if isinstance(err, InvalidReplicatorConfig) else f"replicator.yaml is unusable: {err}"
        why = (
            "refused at once: no later write makes it valid"
            if final
            else f"unchanged for {unsettled.settle_seconds:g} s, so not a file still being written"
        )
        _refuse(disk, meta, f"{what} ({why})")
        unsettled.forget(job)
        return
    unsettled.forget(job)
    try:
        await client.record_settings(progress.pod_rank(job), settings)
    except CoordinatorUnavailable as err:
        log_once(f"settings-{disk.job}", f"cannot record job settings with the coordinator, retrying: {err}", meta)
        return
    progress.settings = settings
    meta.save_progress(progress)
    framework.consume_config(disk.client_dir)
    REPLICATOR_YAML.labels("accepted").inc()
    log.info("%s/%s rank %d: consumed replicator.yaml %s", disk.namespace, disk.job, progress.rank, settings)


def _parse(framework: Framework, data: bytes, rank: int, nodes: int) -> JobSettings:
    """``framework.parse_config`` of the file's bytes (UTF-8), for a worker thread."""
    return framework.parse_config(data.decode("utf-8"), rank, nodes)


def _refuse(disk: Ramdisk, meta: JobMeta, message: str) -> None:
    """Tells the job its ``replicator.yaml`` is refused (``replicator.failed``), then consumes it."""
    log.error("%s/%s: rejected replicator.yaml: %s", disk.namespace, disk.job, message)
    meta.framework.report_failure(disk.client_dir, meta.root, message)
    meta.framework.consume_config(disk.client_dir)  # Orbax reads replicator.failed only once the yaml is gone
    REPLICATOR_YAML.labels("rejected").inc()
