"""Stages a step in the client dir for the job's framework: fetch (or move) it, verify every checksum, then hand over.

Only a verified copy is ever placed where a restore marker can point at it; a copy that fails
verification is reported so the coordinator can choose another source or an older step.
"""

import contextlib
import dataclasses
import logging
import os
import stat

from replicator.local_tier import pod_files, steps
from replicator.local_tier.frameworks import Framework
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import StepManifest, UnusableCopy, check_step

log = logging.getLogger(__name__)


def stage_local(
    framework: Framework,
    local_dir: str,
    step: int,
    manifest: StepManifest | None,
    meta: JobMeta | None = None,
    rank: int | None = None,
) -> None:
    """Verifies this node's own copy of ``step`` and moves it to the staged name.

    Args:
      framework: the job's framework (the client dir's layout).
      local_dir: the client dir.
      step: the step to restore.
      manifest: the checksums recorded when the step committed, or None if none were.
      meta, rank: where to look for the step when an earlier restore set it aside (see
        ``clear_for_restore``), as the node's own copy of ``rank``.

    Raises:
      CorruptCopy: the copy fails its checksums.
      UnusableCopy: the step is not held here, has no manifest, or its files are not its manifest's.
    """
    found = framework.find_step_dir(local_dir, step)
    if found is None and meta is not None and (aside := meta.replicas().get((rank, step))) is not None:  # type: ignore[arg-type]  # a None rank finds nothing
        _stage_set_aside(framework, local_dir, step, meta, aside)
        return
    if found is None or manifest is None:
        raise UnusableCopy(f"step {step} is not held here" if found is None else f"step {step} has no manifest")
    check_step(found, manifest, f"the local copy of step {step}")  # the restore logs and reports a failure
    staged = framework.staged_name(step)
    with pod_files.open_dir(local_dir) as fd:
        if os.path.basename(found) != staged:
            os.rename(str(step), staged, src_dir_fd=fd, dst_dir_fd=fd)
        elif (link := pod_files.lstat(fd, str(step))) is not None and stat.S_ISLNK(link.st_mode):
            os.unlink(str(step), dir_fd=fd)  # the marker of an earlier restore; the job recreates it from ours
        pod_files.fsync_dir(fd)


def _stage_set_aside(framework: Framework, local_dir: str, step: int, meta: JobMeta, manifest: StepManifest) -> None:
    """Verifies a step set aside by an earlier restore and moves it back, staged; it is the node's
    own step again (its manifest follows it). Raises as ``stage_local``."""
    aside = meta.replica_dir(manifest.rank, step)
    check_step(aside, manifest, f"the set-aside copy of step {step}")
    install_staged(framework, local_dir, step, aside)
    meta.save_manifest(manifest)
    meta.drop_replica(manifest.rank, step)


def install_staged(framework: Framework, local_dir: str, step: int, verified_dir: str) -> None:
    """Moves a fetched and verified step directory (on the same ramdisk) to the staged name."""
    steps.delete_step(framework, local_dir, step)
    with pod_files.open_dir(local_dir) as fd:
        os.rename(verified_dir, framework.staged_name(step), dst_dir_fd=fd)
        pod_files.fsync_dir(fd)


def clear_for_restore(
    framework: Framework, local_dir: str, step: int | None, meta: JobMeta, rank: int, set_aside: bool = True
) -> list[int]:
    """Takes committed steps newer than ``step`` (all of them when None) out of the client dir, and
    removes old markers.

    A step the job would restore instead of the one every rank agreed on
    (``Framework.steps_restored_instead``) would split the job. Such a step is not complete everywhere now, but it may be again (a silent
    holder comes back): one with a manifest is *set aside*, moved (one rename on the same ramdisk)
    into the agent's area as ``meta``'s replica of ``rank``, where it stays reported and restorable
    until a step newer than ``step`` is safe (garbage collection). Only a step without a manifest
    (never checksummed) or that is not a directory is deleted. A staged copy nothing points at (a restore replanned
    to another step) is set aside the same way when newer than ``step``, deleted when older; every newer step is
    deleted when ``set_aside`` is False (a rollback abandons them).

    Returns:
      The steps taken out of the client dir (set aside or deleted).
    """
    framework.remove_markers(local_dir)
    scan = framework.scan_steps(local_dir)
    removed = framework.steps_restored_instead(scan, step)
    manifests = meta.manifests()
    for stale in removed:
        if (
            set_aside
            and stale in scan.committed
            and stale in manifests
            and _set_aside(framework, local_dir, stale, meta, manifests[stale], rank)
        ):
            log.warning("set aside step %d of %s: not restorable on every rank now", stale, local_dir)
        steps.delete_step(framework, local_dir, stale)
        meta.drop_manifest(stale)
    with pod_files.open_dir(local_dir) as fd:
        linked = set()
        for name, status in pod_files.names(fd):
            if stat.S_ISLNK(status.st_mode):
                with contextlib.suppress(OSError):
                    linked.add(os.readlink(name, dir_fd=fd))
        unlinked = [s for s in scan.staged if s != step and framework.staged_name(s) not in linked]
    for staged in unlinked:
        # A newer step staged for a restore that was replanned to an older one may be the last copy of its rank:
        # set aside like a committed one (its manifest is the one it was verified against), never deleted.
        manifest = manifests.get(staged) if set_aside and (step is None or staged > step) else None
        if manifest is not None and _set_aside(framework, local_dir, staged, meta, manifest, manifest.rank):
            log.warning("set aside staged step %d of %s: the restore was replanned to step %s", staged, local_dir, step)
            meta.drop_manifest(staged)
            continue
        with pod_files.open_dir(local_dir) as fd:
            pod_files.remove(fd, framework.staged_name(staged))
    return removed


def _set_aside(
    framework: Framework, local_dir: str, step: int, meta: JobMeta, manifest: StepManifest, rank: int
) -> bool:
    """Moves a committed step's directory out of the client dir into ``meta`` as a replica of
    ``rank``; False when what has the step's name is not a directory (then it is deleted)."""
    found = framework.find_step_dir(local_dir, step)
    if found is None:
        return False
    parent = meta.new_incoming_dir()  # on the same ramdisk: one rename, no copy
    with pod_files.open_dir(local_dir) as fd:
        os.rename(os.path.basename(found), os.path.join(parent, "step"), src_dir_fd=fd)
        pod_files.fsync_dir(fd)
    with pod_files.open_dir(parent) as fd:
        if not pod_files.is_dir(fd, "step"):  # the pod swapped it for something else meanwhile
            pod_files.remove(fd, "step")
            return False
    meta.install_replica(os.path.join(parent, "step"), dataclasses.replace(manifest, rank=rank))
    return True
