"""Garbage collection on the node: carries out the coordinator's retain orders for a job's ramdisk."""

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier.job_keys import BusySteps, job_of
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.parity_shards import ParityShards
from replicator.local_tier.steps import GC_DELETED, delete_step, drop_abandoned
from replicator.node.handshake import current_pod
from replicator.wire.messages import RetainOrder


def collect_garbage(disk: Ramdisk, order: RetainOrder, busy_steps: BusySteps, asked_at: float | None = None) -> None:
    """Deletes own steps, replicas and parity shards older than the newest safe step (see ``RetainOrder``), the
    steps the pod's restore set aside once a step newer than the restored one is safe, and
    copies of abandoned timelines (finishing a deletion an agent restart interrupted).
    Steps in ``busy_steps`` (being read by a push or an upload) are kept, and so are the steps a restore was told
    to stage at or after ``asked_at`` (when the node sent the report ``order`` answers, monotonic seconds; None:
    not an answer to a report): a restore replanned to an older step stages it while an order from before the
    replan may still be on its way, and carried out it would delete the staged step under the job's marker."""
    drop_abandoned(disk)
    meta = JobMeta(disk.path)
    job = job_of(disk)
    keep = set(order.protected) | busy_steps.of(job)
    if asked_at is not None:
        keep |= busy_steps.restored_after(job, asked_at)
    for step in meta.manifests():
        if step < order.keep_from and step not in keep:
            meta.drop_manifest(step)  # first: a step is never reported once its deletion began
            delete_step(meta.framework, disk.client_dir, step)
            GC_DELETED.inc()
    spec = current_pod(disk)
    progress = meta.progress(spec.pod_uid) if spec else None
    restored = restored_step(disk, meta)
    for rank, step in meta.replicas():
        set_aside = progress is not None and rank == progress.rank and restored is not None
        if (
            step < order.keep_from or (set_aside and restored is not None and order.keep_from > restored)
        ) and step not in keep:
            meta.drop_replica(rank, step)
            GC_DELETED.inc()
    GC_DELETED.inc(ParityShards(disk.path).drop_older(order.keep_from, keep))


def restored_step(disk: Ramdisk, meta: JobMeta) -> int | None:
    """The step the current pod's restore handed over (-1: a fresh start), or None before it is done."""
    spec = current_pod(disk)
    progress = meta.progress(spec.pod_uid) if spec else None
    return progress.handing_over if progress and progress.restore_done else None


def pressure_order(disk: Ramdisk, order: RetainOrder | None) -> RetainOrder | None:
    """What ``space.make_room`` may go by: the coordinator's latest retain order, else, once the pod restored a
    step, everything newer than it (the job's unsafe new saves, steps a restore set aside): no step newer than the
    one every rank restored is safe. None (nothing given up) before a restore, or after a fresh start."""
    if order is not None:
        return order
    restored = restored_step(disk, JobMeta(disk.path))
    return RetainOrder(disk.namespace, disk.job, restored, ()) if restored is not None and restored >= 0 else None
