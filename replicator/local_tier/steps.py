"""Deleting steps from a job's ramdisk: crash-safe (renamed to a trash name first, then removed), and
the copies of timelines a rollback abandoned. Garbage collection and the restore path both use it."""

import os
import secrets

from prometheus_client import Counter

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier import pod_files
from replicator.local_tier.frameworks import Framework
from replicator.local_tier.job_meta import JobMeta
from replicator.wire.messages import abandoned

_TRASH_PREFIX = ".mtc-trash-"  # not a step name: the job ignores it

GC_DELETED = Counter("mtc_gc_deleted_steps_total", "Steps and replicas deleted by garbage collection")


def drop_abandoned(disk: Ramdisk) -> None:
    """Deletes the job's own steps and replicas of timelines a rollback abandoned
    (``messages.abandoned``): they are never restored again, and their step numbers are reused."""
    meta = JobMeta(disk.path)
    forks = meta.lineage()
    if not forks:
        return
    for step, manifest in meta.manifests().items():
        if abandoned(forks, step, manifest.timeline):
            meta.drop_manifest(step)  # first: a step is never reported once its deletion began
            delete_step(meta.framework, disk.client_dir, step)
            GC_DELETED.inc()
    for (rank, step), manifest in meta.replicas().items():
        if abandoned(forks, step, manifest.timeline):
            meta.drop_replica(rank, step)
            GC_DELETED.inc()


def delete_step(framework: Framework, local_dir: str, step: int) -> None:
    """Deletes a step from the client dir: everything under one of its names (``Framework.step_names``:
    its directory or whatever has its name, its staged copy).

    Each is first renamed to a trash name in one atomic step, so a crash mid-delete never leaves a
    partial step under a step's name (``sweep_trash`` removes the rest at the next start).
    """
    with pod_files.open_dir(local_dir) as fd:
        for name in framework.step_names(step):
            trash = f"{_TRASH_PREFIX}{secrets.token_hex(8)}"
            try:
                os.rename(name, trash, src_dir_fd=fd, dst_dir_fd=fd)
            except FileNotFoundError:
                continue  # never there, or the job deleted it itself meanwhile
            pod_files.remove(fd, trash)


def sweep_trash(local_dir: str) -> None:
    """Finishes deletions a crash interrupted (see ``delete_step``)."""
    with pod_files.open_dir(local_dir) as fd:
        for name, _ in pod_files.names(fd):
            if name.startswith(_TRASH_PREFIX):
                pod_files.remove(fd, name)
