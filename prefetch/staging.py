"""Stages a step in the client dir for Orbax: fetch (or move) it, verify every checksum, then hand over.

Only a verified copy is ever placed where a restore marker can point at it; a copy that fails
verification is reported so the coordinator can choose another source or an older step.
"""

import logging
import os
import shutil

from replicator import orbax_protocol
from replicator.step_manifest import StepManifest, verify_step

log = logging.getLogger(__name__)


def stage_local(local_dir: str, step: int, manifest: StepManifest | None) -> list[str]:
    """Verifies this node's own copy of ``step`` and moves it to the staged name.

    Args:
      local_dir: the client dir.
      step: the step to restore.
      manifest: the checksums recorded when the step committed, or None if none were.

    Returns:
      Problems found; empty when the step is staged and verified.
    """
    found = orbax_protocol.find_step_dir(local_dir, step)
    if found is None or manifest is None:
        return [f"step {step} is not held here" if found is None else f"step {step} has no manifest"]
    problems = verify_step(found, manifest)
    if problems:
        log.error("local copy of step %d is corrupt: %s", step, problems[:5])
        return problems
    staged = orbax_protocol.staged_step_dir(local_dir, step)
    committed = os.path.join(local_dir, str(step))
    if os.path.islink(committed):
        target = os.path.join(local_dir, os.readlink(committed))
        os.unlink(committed)  # a marker from an earlier restore; Orbax recreates <step> from ours
        if os.path.realpath(target) != os.path.realpath(staged):
            os.replace(target, staged)
    elif found != staged:
        os.replace(found, staged)
    return []


def install_staged(local_dir: str, step: int, verified_dir: str) -> None:
    """Moves a fetched and verified step directory (on the same ramdisk) to the staged name."""
    staged = orbax_protocol.staged_step_dir(local_dir, step)
    delete_step(local_dir, step)
    os.replace(verified_dir, staged)


def delete_step(local_dir: str, step: int) -> None:
    """Deletes a step from the client dir: its directory, or its symlink and the staged target."""
    committed = os.path.join(local_dir, str(step))
    if os.path.islink(committed):
        os.unlink(committed)
    elif os.path.isdir(committed):
        shutil.rmtree(committed)
    shutil.rmtree(orbax_protocol.staged_step_dir(local_dir, step), ignore_errors=True)


def clear_for_restore(local_dir: str, step: int | None) -> list[int]:
    """Removes committed steps newer than ``step`` (all of them when None) and old markers.

    Orbax restores the newest step it finds, so a step newer than the one every rank agreed on
    would split the job. Those steps are not complete everywhere and are removed, as are staged
    copies nothing points at any more.

    Returns:
      The steps removed.
    """
    orbax_protocol.remove_markers(local_dir)
    removed = [s for s in orbax_protocol.committed_steps(local_dir) if step is None or s > step]
    for stale in removed:
        delete_step(local_dir, stale)
    linked = {os.readlink(e.path) for e in os.scandir(local_dir) if e.is_symlink()}
    for entry in os.scandir(local_dir):
        if entry.name.startswith(orbax_protocol.STAGED_PREFIX) and entry.name not in linked:
            if entry.path != orbax_protocol.staged_step_dir(local_dir, step if step is not None else -1):
                shutil.rmtree(entry.path)
    if removed:
        log.warning("removed steps %s from %s: not restorable on every rank", removed, local_dir)
    return removed
