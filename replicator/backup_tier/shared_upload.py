"""Shared backup uploads: the D ranks of a group found identical at a step split its upload.

Each member uploads the files whose path falls to it (a stable hash of the path over the group), and
stores them as its *share* (``rank-<r>.share.json``, same format as a rank manifest). Once every
member's share of the same incarnation is stored, each member uploads its full rank manifest with
the union of the shares as ``dedup_from``: a file whose path, size and content identity equal a
share's names that object, anything else (files only this rank has, or whose bytes differ) is
uploaded by the rank itself. ``COMMIT`` still waits for every rank's full manifest, so a step is
restorable only once every file of every rank is stored and checked. Each member sends about 1/D of
the shared bytes instead of one leader sending all of them.

A rank whose node was lost mid-backup may be stood in for by a data-parallel peer holding the step in the
rank's bytes (``reference``): the rank's manifest names the peer's objects, and nothing is uploaded.
"""

import dataclasses
import zlib

from replicator.backup_tier.layout import COMMIT, RankManifest, step_prefix
from replicator.backup_tier.object_store import BackupError
from replicator.backup_tier.store import BackupStore
from replicator.backup_tier.transfers import RankUpload
from replicator.wire.messages import JobRef


def owner(members: tuple[int, ...], rel: str) -> int:
    """The member of ``members`` (the group's ranks, sorted) that uploads the file at ``rel``; the
    same on every member, whatever else its step holds."""
    return members[zlib.crc32(rel.encode()) % len(members)]


def group_dedup(store: BackupStore, upload: RankUpload, members: tuple[int, ...]) -> RankManifest | None:
    """Stores this rank's share of the group's upload (once per incarnation), then returns the union
    of the group's shares, to pass to ``BackupStore.upload_rank`` as ``dedup_from``.

    Args:
      upload: this rank's step (``upload.rank``, one of ``members``), as ``BackupStore.upload_rank`` takes it;
        its ``dedup_from``, ``on_file`` and ``group_share`` are not read.
      members: the ranks of the group, sorted.

    Returns:
      The union of every member's share, or None while a member's share (of ``upload.incarnation``) is not
      stored yet: call again later.

    Raises:
      BackupError, OSError, ValueError: as ``BackupStore.upload_rank``.
    """
    job, step, rank, timeline, incarnation = upload.job, upload.step, upload.rank, upload.timeline, upload.incarnation
    mine = store.rank_manifest(job, step, rank, timeline, group_share=True)
    if mine is None or mine.incarnation != incarnation:
        manifest = upload.manifest
        owned = dataclasses.replace(
            manifest, files={rel: f for rel, f in manifest.files.items() if owner(members, rel) == rank}
        )
        mine = store.upload_rank(
            dataclasses.replace(upload, manifest=owned, dedup_from=None, on_file=None, group_share=True)
        )
    shares = {rank: mine}
    for member in members:
        if member != rank:
            share_of_member = store.rank_manifest(job, step, member, timeline, group_share=True)
            if share_of_member is None or share_of_member.incarnation != incarnation:
                return None
            shares[member] = share_of_member
    files = {rel: f for member in members for rel, f in shares[member].files.items() if owner(members, rel) == member}
    return RankManifest(step, rank, files, incarnation, timeline)


def reference(store: BackupStore, job: JobRef, rank: int, source: RankManifest) -> RankManifest:
    """Stores ``rank``'s manifest of ``source``'s step naming ``source``'s objects, uploading nothing: for a rank
    whose data is ``source``'s byte for byte, which the caller established (a data-parallel peer whose checksums of
    the step are the rank's, ``BackupOrder.data_rank``). A restore of ``rank`` reads those objects and checks them
    against these checksums.

    Args:
      source: another rank's stored manifest of the step (``BackupStore.rank_manifest``), of the backup's tag.

    Returns:
      ``rank``'s stored manifest: the one stored already under ``source``'s tag (the rank's own upload, or an earlier
      reference), else the new one.

    Raises:
      ValueError: bad job.
      BackupError: the step is committed without a manifest of that tag for ``rank``, or the store failed.
    """
    step, timeline, incarnation = source.step, source.timeline, source.incarnation
    stored = store.rank_manifest(job, step, rank, timeline)
    if stored is not None and stored.incarnation == incarnation:
        return stored
    prefix = step_prefix(job, step, timeline)
    if COMMIT in store.objects.list(prefix):
        raise BackupError(f"{store.url}/{prefix} is committed with other data; a committed step is never overwritten")
    referenced = RankManifest(step, rank, dict(source.files), incarnation, timeline)
    store.write_manifest(job, referenced)
    return referenced
