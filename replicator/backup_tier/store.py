"""The backup tier's storage: complete checkpoint steps in object storage, restorable after cluster loss.

The backup logic (dedup, commit, restore, retention) lives once, in ``BackupStore``, over an
``object_store.ObjectStore``: a handful of object primitives that each backend implements
(``gcs.py``, ``s3.py``, ``filesystem.py``). ``backends.open_backup_store(url)`` gives a ``BackupStore``
for ``gs://BUCKET[/PREFIX]``, ``s3://BUCKET[/PREFIX]`` or ``file:///PATH``. The object names and the
rank manifests are ``layout``'s; the transfers of a rank's files are ``transfers``'.
"""

import json
import os
from collections.abc import Callable, Iterable

from replicator.backup_tier.layout import (
    COMMIT,
    MANIFEST_NAME,
    STEP_ENTRY,
    RankManifest,
    StepId,
    UnusableBackup,
    job_prefix,
    manifest_name,
    step_prefix,
)
from replicator.backup_tier.object_store import BackupError, ObjectStore, run_parallel
from replicator.backup_tier.transfers import RankUpload, download_files, upload_files
from replicator.local_tier.step_manifest import StepManifest
from replicator.wire.messages import JobRef, abandoned

DEFAULT_WORKERS = 8


class BackupStore:
    """Backed-up checkpoint steps of many jobs, over one ``ObjectStore``. Thread-safe; holds no state
    beyond its configuration, so several node agents may use the same store at once.

    Args:
      objects: the backend.
      workers: concurrent transfers for uploads and deletions.
    """

    def __init__(self, objects: ObjectStore, *, workers: int = DEFAULT_WORKERS):
        self.objects = objects
        self.workers = workers

    @property
    def url(self) -> str:
        return self.objects.url

    def upload_rank(self, upload: RankUpload) -> RankManifest:
        """Stores one rank's committed step (``upload``), then its rank manifest.

        A file whose relative path, size and content identity equal a file of ``upload.dedup_from`` (a rank
        manifest of the same step already stored, from ``rank_manifest``, typically a data-parallel peer's) is
        not uploaded: the new manifest names the peer's object, so identical data is stored once. CRC32C
        alone cannot tell such files apart (see ``file_identity``). The identity is computed in the
        scheme of the peer's file, so a peer's manifest from before BLAKE3 still deduplicates.

        Returns:
          The stored rank manifest (pass it as ``dedup_from`` for the next peer).

        Raises:
          ValueError: bad job, ``manifest`` is for another step or rank, ``dedup_from`` is for
            another step, or a path in ``manifest`` leaves the step directory.
          BackupError: an upload failed or did not match ``manifest``; no rank manifest is written, so
            the step stays incomplete (``retain`` removes what was uploaded once a newer step commits).
            Or the step is committed already, with other data or by another incarnation: it is left alone.
          OSError: a local file could not be read.
        """
        job, step, rank, timeline, incarnation = (
            upload.job,
            upload.step,
            upload.rank,
            upload.timeline,
            upload.incarnation,
        )
        prefix = step_prefix(job, step, timeline)
        _check_upload(upload)
        if COMMIT in self.objects.list(prefix):
            if upload.group_share:
                return RankManifest(step, rank, {}, incarnation, timeline)  # committed: nothing left to share
            return self._committed_as(job, step, rank, upload.manifest, incarnation, timeline)
        files = upload_files(self.objects, self.workers, upload, prefix)
        stored = RankManifest(step, rank, files, incarnation, timeline)
        self.write_manifest(job, stored, upload.group_share)
        return stored

    def write_manifest(self, job: JobRef, stored: RankManifest, group_share: bool = False) -> None:
        """Writes ``stored`` as its rank's manifest (``group_share``: share) of its step: call once all it names is
        stored and the step is not committed. Replaces one an interrupted upload left (another incarnation, or bytes since changed): the step is not
        committed (the caller checked), and a rank's manifest has one writer per incarnation.

        Raises:
          BackupError: the store failed, or another uploader wrote it meanwhile.
        """
        name = step_prefix(job, stored.step, stored.timeline) + manifest_name(stored.rank, group_share)
        if (
            not self.objects.create_text(name, stored.to_json())
            and self.rank_manifest(job, stored.step, stored.rank, stored.timeline, group_share) != stored
        ):
            self.objects.delete(name)
            if not self.objects.create_text(name, stored.to_json()):
                raise BackupError(f"{self.url}/{name}: written by another uploader meanwhile")

    def _committed_as(
        self, job: JobRef, step: int, rank: int, manifest: StepManifest, incarnation: str, timeline: int
    ) -> RankManifest:
        """The stored rank manifest of a committed ``step`` if it holds ``manifest``'s data from
        ``incarnation`` (a retried upload); raises ``BackupError`` otherwise."""
        stored = self.rank_manifest(job, step, rank, timeline)
        if stored is None or stored.incarnation != incarnation or stored.step_manifest().files != manifest.files:
            raise BackupError(
                f"{self.url}/{step_prefix(job, step, timeline)} is committed with other data; "
                f"a committed step is never overwritten"
            )
        return stored

    def rank_manifest(
        self, job: JobRef, step: int, rank: int, timeline: int = 0, group_share: bool = False
    ) -> RankManifest | None:
        """A stored rank manifest (``group_share``: the rank's share of its group's upload), or None
        when that rank's upload of ``step`` (of ``timeline``) has not finished.

        Raises:
          ValueError: bad job (not DNS-1123 labels).
          BackupError: the store failed, or the manifest is malformed.
        """
        name = step_prefix(job, step, timeline) + manifest_name(rank, group_share)
        text = self.objects.read_text(name)
        if text is None:
            return None
        try:
            stored = RankManifest.from_json(text)
        except ValueError as exc:
            raise BackupError(f"{self.url}/{name}: {exc}") from exc
        if (stored.step, stored.rank, stored.timeline) != (step, rank, timeline):
            raise BackupError(
                f"{self.url}/{name} is for step {stored.step} rank {stored.rank} timeline {stored.timeline}"
            )
        return stored

    def commit_if_complete(
        self, job: JobRef, step: int, nodes: int, incarnation: str | None = None, timeline: int = 0
    ) -> bool:
        """Writes ``COMMIT`` for ``step`` of ``timeline`` when the manifests of ranks ``0 .. nodes-1``
        all exist (and, with ``incarnation``, all come from that incarnation).

        Idempotent; safe to call from every node after its own upload.

        Returns:
          True if the step is committed (now or before), False while a rank manifest is missing.

        Raises:
          ValueError: bad job (not DNS-1123 labels), or ``nodes`` < 1.
          BackupError: the store failed.
        """
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, not {nodes}")
        prefix = step_prefix(job, step, timeline)
        entries = set(self.objects.list(prefix))
        if COMMIT in entries:
            return True
        if any(manifest_name(rank) not in entries for rank in range(nodes)):
            return False
        if incarnation is not None and any(
            getattr(self.rank_manifest(job, step, rank, timeline), "incarnation", None) != incarnation
            for rank in range(nodes)
        ):
            return False
        commit = {"step": step, "nodes": nodes, "ranks": list(range(nodes))}
        self.objects.create_text(prefix + COMMIT, json.dumps(commit, sort_keys=True))  # False: a peer was first
        return True

    def steps(self, job: JobRef, partial: bool = False) -> dict[StepId, bool]:
        """Every (step, timeline) with anything stored -> whether it has ``COMMIT``.

        Args:
          job: the job.
          partial: also the steps that only have partial (multipart) uploads: one more listing of the store.

        Raises:
          ValueError: bad job (not DNS-1123 labels).
          BackupError: the store failed.
        """
        prefix = job_prefix(job)
        entries = self.objects.list(prefix)
        if partial:
            entries += [n.split("/")[0] + "/" for n in self.objects.partial_uploads(prefix)]
        found = {(int(m[1]), int(m[2] or 0)) for entry in entries if (m := STEP_ENTRY.match(entry))}
        return {
            (step, timeline): COMMIT in self.objects.list(step_prefix(job, step, timeline)) for step, timeline in found
        }

    def complete_steps(self, job: JobRef) -> list[StepId]:
        """(step, timeline) of the steps with ``COMMIT``, ascending: the restorable ones.

        Raises:
          ValueError: bad job (not DNS-1123 labels).
          BackupError: the store failed.
        """
        return sorted(step for step, committed in self.steps(job).items() if committed)

    def committed_nodes(self, job: JobRef, step: int, timeline: int = 0) -> int:
        """The number of nodes (rank manifests ``0 .. N-1``) of a committed step, from its ``COMMIT``.

        Raises:
          ValueError: bad job (not DNS-1123 labels).
          UnusableBackup: the step has no ``COMMIT``, or it is malformed.
          BackupError: the store failed.
        """
        name = step_prefix(job, step, timeline) + COMMIT
        text = self.objects.read_text(name)
        if text is None:
            raise UnusableBackup(f"{self.url}/{name} is missing: step {step} is not restorable")
        try:
            nodes = json.loads(text)["nodes"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UnusableBackup(f"{self.url}/{name} is malformed: {exc}") from exc
        if not isinstance(nodes, int) or nodes < 1:
            raise UnusableBackup(f"{self.url}/{name} names {nodes!r} nodes")
        return nodes

    def download_rank(
        self,
        job: JobRef,
        step: int,
        rank: int,
        dest_dir: str,
        workers: int = DEFAULT_WORKERS,
        timeline: int = 0,
        on_range: Callable[[int], None] | None = None,
    ) -> StepManifest:
        """Restores one rank's data of a committed step into ``dest_dir``, verified.

        Files are fetched as ranged reads of up to ``transfers.RANGE_BYTES`` (32 MiB), ``workers`` at a time,
        into a temporary sibling of ``dest_dir``, checked with ``check_step``, and only then renamed
        to ``dest_dir`` (``transfers.download_files``). On any failure nothing is left behind. Zero-byte
        files are recreated from the manifest alone.

        Args:
          job: the job.
          step: a step listed by ``complete_steps``.
          rank: the node rank.
          dest_dir: must not exist; its parent must. Files land at their relative paths below it.
          workers: concurrent ranged reads.
          timeline: the step's timeline (as ``complete_steps`` lists it).
          on_range: called (from a worker thread) with each range's length in bytes once it is written, or None.

        Returns:
          The manifest ``dest_dir`` was verified against.

        Raises:
          ValueError: bad job (not DNS-1123 labels).
          FileExistsError: ``dest_dir`` exists.
          BackupError: the step has no ``COMMIT``, the rank has no manifest, an object is missing or
            short, the data does not match its checksums, or the store failed.
          OSError: writing below ``dest_dir``'s parent failed (e.g. the ramdisk is full).
        """
        prefix = step_prefix(job, step, timeline)
        if COMMIT not in self.objects.list(prefix):
            raise UnusableBackup(f"{self.url}/{prefix} has no {COMMIT}: step {step} is not restorable")
        stored = self.rank_manifest(job, step, rank, timeline)
        if stored is None:
            raise UnusableBackup(f"{self.url}/{prefix} has {COMMIT} but no manifest for rank {rank}")
        if os.path.lexists(dest_dir):
            raise FileExistsError(f"{dest_dir} exists")
        return download_files(self.objects, prefix, stored, dest_dir, workers, on_range)

    def delete_step(self, job: JobRef, step: int, timeline: int = 0) -> None:
        """Deletes everything stored for ``step`` of ``timeline``: ``COMMIT`` first, then rank
        manifests, then data, then partial uploads.

        Raises:
          ValueError: bad job (not DNS-1123 labels).
          BackupError: the store failed; what remains is an incomplete step.
        """
        prefix = step_prefix(job, step, timeline)
        names = self.objects.list(prefix, recursive=True)
        if COMMIT in names:
            self.objects.delete(prefix + COMMIT)
        manifests = [prefix + n for n in names if MANIFEST_NAME.match(n)]
        data = [prefix + n for n in names if n != COMMIT and not MANIFEST_NAME.match(n)]
        run_parallel(self.objects.delete, manifests, self.workers)
        run_parallel(self.objects.delete, data, self.workers)
        self.objects.abort_partial_uploads(prefix)

    def retain(
        self, job: JobRef, keep: int, protected: Iterable[int] = (), forks: tuple[int, ...] = ()
    ) -> list[StepId]:
        """Garbage-collects a job's backups.

        Deletes every step of an abandoned timeline (``messages.abandoned``). Of the others, keeps the
        newest ``keep`` complete steps and every protected step; deletes the other complete steps, and
        the incomplete steps older than the newest complete one (interrupted uploads, including their
        partial multipart uploads). Incomplete steps newer than it may still be uploading and are kept.

        Args:
          job: the job.
          keep: complete steps to keep, >= 1.
          protected: steps never deleted (e.g. one a restore is reading), unless abandoned.
          forks: the job's rollbacks (``BackupOrder.forks``).

        Returns:
          The deleted (step, timeline) pairs, ascending.

        Raises:
          ValueError: bad job (not DNS-1123 labels), or ``keep`` < 1.
          BackupError: the store failed.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        protected = set(protected)
        steps = self.steps(job, partial=True)
        doomed = {s for s in steps if abandoned(forks, *s)}
        complete = sorted(s for s, committed in steps.items() if committed and s not in doomed)
        if complete:
            newest = complete[-1][0]
            doomed |= {s for s in complete[:-keep] if s[0] not in protected}
            doomed |= {s for s, committed in steps.items() if not committed and s[0] < newest and s[0] not in protected}
        deleted = sorted(doomed)
        for step, timeline in deleted:
            self.delete_step(job, step, timeline)
        return deleted


def _check_upload(upload: RankUpload) -> None:
    """Raises ValueError when ``upload``'s manifest or ``dedup_from`` is not of its step (and rank)."""
    manifest, dedup_from, step, rank = upload.manifest, upload.dedup_from, upload.step, upload.rank
    if (manifest.step, manifest.rank) != (step, rank):
        raise ValueError(f"manifest is for step {manifest.step} rank {manifest.rank}, not step {step} rank {rank}")
    if dedup_from is not None and (dedup_from.step, dedup_from.timeline) != (step, upload.timeline):
        raise ValueError(
            f"dedup_from is for step {dedup_from.step} of timeline {dedup_from.timeline}, not {step} of "
            f"{upload.timeline}: objects are shared within a step only"
        )
