"""A rank's files to and from the store: the upload with deduplication, and the verified ranged download."""

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
from collections.abc import Callable

from replicator.backup_tier.layout import CorruptBackup, RankManifest, StoredFile, UnusableBackup
from replicator.backup_tier.object_store import ObjectStore, Upload, run_parallel
from replicator.local_tier import pod_files
from replicator.local_tier.step_manifest import (
    IDENTITY_SCHEME,
    IDENTITY_SCHEMES,
    StepManifest,
    check_step,
    file_identity,
    safe_relpath,
)
from replicator.pacing.cpu_share import CpuShare
from replicator.wire.messages import JobRef

RANGE_BYTES = 32 << 20  # one ranged read during a restore


@dataclasses.dataclass(frozen=True)
class RankUpload:
    """One rank's committed step to store (``BackupStore.upload_rank``).

    Attributes:
      job: the job.
      step: the step.
      rank: the node rank whose data ``step_dir`` holds.
      step_dir: the committed step directory on this node.
      manifest: ``step_dir``'s checksums (``step_manifest.build_manifest``); every stored object is
        checked against them.
      dedup_from: a stored rank manifest of the same step, or None to upload everything.
      incarnation: the uploading job incarnation (see ``RankManifest``).
      share: the agent's CPU cap for computing content identities, or None.
      timeline: the job's timeline to store the step as (see ``layout``).
      on_file: called (from a worker thread) with each file's size in bytes once it is stored,
        or found stored already (a deduplicated file at once), or None.
      group_share: ``manifest`` holds only the files this rank uploads for its identical group
        (``shared_upload``): its manifest is stored as the rank's share, which commits nothing.
    """

    job: JobRef
    step: int
    rank: int
    step_dir: str
    manifest: StepManifest
    dedup_from: RankManifest | None = None
    incarnation: str = ""
    share: CpuShare | None = None
    timeline: int = 0
    on_file: Callable[[int], None] | None = None
    group_share: bool = False


def upload_files(objects: ObjectStore, workers: int, upload: RankUpload, prefix: str) -> dict[str, StoredFile]:
    """Stores the files of ``upload.manifest`` below ``prefix`` (the step's), but those equal to a file of
    ``upload.dedup_from`` (path, size and content identity), which keep the peer's object.

    Returns:
      relative path -> where its bytes are stored.

    Raises:
      BackupError: an upload failed or did not match the manifest.
      OSError: a local file could not be read.
    """
    peer = upload.dedup_from.files if upload.dedup_from is not None else {}
    files: dict[str, StoredFile] = {}
    uploads: list[Upload] = []
    on_file = upload.on_file
    with contextlib.ExitStack() as opened, pod_files.open_dir(upload.step_dir) as root:
        for rel, (size, crc) in sorted(upload.manifest.files.items()):
            same = peer.get(safe_relpath(rel))  # the path check guards the object name built from it
            # Opened without following links and read through /proc/self/fd: a file the pod
            # swaps for a symlink after the manifest was built cannot redirect the upload.
            fd = pod_files.open_relative(root, rel)
            opened.callback(os.close, fd)
            peer_scheme = same.identity.partition(":")[0] if same is not None else ""
            identity = file_identity(
                fd, peer_scheme if peer_scheme in IDENTITY_SCHEMES else IDENTITY_SCHEME, share=upload.share
            )
            if same is not None and (same.size, same.crc32c, same.identity) == (size, crc, identity):
                files[rel] = same
                if on_file is not None:
                    on_file(size)
                continue
            files[rel] = StoredFile(size, crc, f"rank-{upload.rank}/{rel}", identity)
            uploads.append(Upload(pod_files.proc_path(fd), prefix + files[rel].object, size, crc))
        objects.put_files(uploads, workers, None if on_file is None else lambda done: on_file(done.size))
    return files


def download_files(
    objects: ObjectStore,
    prefix: str,
    stored: RankManifest,
    dest_dir: str,
    workers: int,
    on_range: Callable[[int], None] | None,
) -> StepManifest:
    """Fetches the files of ``stored`` (below ``prefix``, the step's) as ranged reads of up to ``RANGE_BYTES``,
    ``workers`` at a time, into a temporary sibling of ``dest_dir``, checks them with ``check_step`` and only
    then renames it to ``dest_dir``; on any failure nothing is left behind.

    Returns:
      The manifest ``dest_dir`` was verified against.

    Raises:
      BackupError: an object is missing or short, the data does not match its checksums, or the store failed.
      OSError: writing below ``dest_dir``'s parent failed (e.g. the ramdisk is full).
    """
    parent, base = os.path.split(os.path.abspath(dest_dir))
    tmp = tempfile.mkdtemp(prefix=f".{base}.backup-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        ranges = []
        for rel, f in stored.files.items():
            path = os.path.join(tmp, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as out:
                out.truncate(f.size)
            ranges += [
                (prefix + f.object, path, start, min(RANGE_BYTES, f.size - start))
                for start in range(0, f.size, RANGE_BYTES)
            ]
        run_parallel(functools.partial(_fetch_range, objects, on_range=on_range), ranges, workers)
        manifest = stored.step_manifest()
        check_step(
            tmp, manifest, f"{objects.url}/{prefix} rank {stored.rank}", unusable=UnusableBackup, corrupt=CorruptBackup
        )
        os.rename(tmp, dest_dir)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fetch_range(objects: ObjectStore, item: tuple[str, str, int, int], on_range: Callable[[int], None] | None) -> None:
    name, path, start, length = item
    fd = os.open(path, os.O_WRONLY)
    try:
        objects.download_range(name, start, length, fd)
    finally:
        os.close(fd)
    if on_range is not None:
        on_range(length)
