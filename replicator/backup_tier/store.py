"""The backup tier's storage: complete checkpoint steps in object storage, restorable after cluster loss.

The backup logic (layout, dedup, commit, restore, retention) lives once, in ``BackupStore``, over an
``object_store.ObjectStore``: a handful of object primitives that each backend implements
(``gcs_backup.py``, ``s3_backup.py``, ``file_backup.py``). ``backup_backends.open_backup_store(url)``
gives a ``BackupStore`` for ``gs://BUCKET[/PREFIX]``, ``s3://BUCKET[/PREFIX]`` or ``file:///PATH``.

Layout below the store's prefix, per job key ``<namespace>/<job>``::

  <ns>/<job>/steps/<step>/rank-<r>/<relpath>      data objects, one per file of the rank's step dir
  <ns>/<job>/steps/<step>/rank-<r>.manifest.json  {"step", "rank", "timeline", "files": {relpath: {"size", "crc32c", "object"}}}
  <ns>/<job>/steps/<step>/rank-<r>.share.json     the same for the files rank r uploaded as its share of its
                                                  identical group's upload (``shared_upload``); never restored
  <ns>/<job>/steps/<step>/COMMIT                  {"step", "nodes", "ranks": [...]}, written last

That is timeline 0; a step of timeline ``t`` > 0 (written after the job's ``t``-th rollback, see
``messages.in_lineage``) lives under ``steps/<step>-t<t>/``, so an abandoned timeline's backup of a
step and the new timeline's are never mixed, and retention deletes the abandoned ones.

A rank manifest is written only after all of its objects are stored and their CRC32C checked against
the step's ``StepManifest``; ``object`` is the object's name relative to the step's directory, so a
deduplicated file names another rank's object of the same step (``rank-0/...``). ``COMMIT`` is written
once every rank's manifest exists; only a step with ``COMMIT`` is restorable. ``COMMIT`` and rank
manifests are created write-once (``ObjectStore.create_text``), and a committed step's objects are
never written again. Deleting a step removes ``COMMIT`` first, so a half-deleted step is never taken
for a complete one.
"""

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable

from csi_driver.volume_request import DNS1123_LABEL
from replicator.backup_tier.object_store import BackupError, ObjectStore, Upload, run_parallel
from replicator.local_tier import pod_files
from replicator.local_tier.step_manifest import (
    IDENTITY_SCHEME,
    IDENTITY_SCHEMES,
    CorruptCopy,
    StepManifest,
    UnusableCopy,
    check_step,
    file_identity,
    safe_relpath,
)
from replicator.pacing.cpu_share import CpuShare
from replicator.wire.messages import abandoned

DEFAULT_WORKERS = 8
RANGE_BYTES = 32 << 20  # one ranged read during a restore

COMMIT = "COMMIT"
_MANIFEST_NAME = re.compile(r"^rank-(\d+)\.manifest\.json$")
_STEP_ENTRY = re.compile(r"^(0|[1-9][0-9]*)(?:-t([1-9][0-9]*))?/$")
StepId = tuple[int, int]  # (step, timeline)


class UnusableBackup(BackupError, UnusableCopy):
    """The backup of a step is incomplete (no ``COMMIT``, no manifest) or its files are not those of its manifest."""


class CorruptBackup(UnusableBackup, CorruptCopy):
    """The backup of a step fails its checksums."""


@dataclasses.dataclass(frozen=True)
class StoredFile:
    """One file of a rank's backed-up step.

    Attributes:
      size: bytes.
      crc32c: CRC32C of the content, 8 lowercase hex digits (as in ``StepManifest``).
      object: the object holding the content, relative to the step's directory (``rank-<r>/<relpath>``).
      identity: ``"<scheme>:<hex digest>"`` of the content, what deduplication compares (see
        ``file_identity``): ``blake3:`` today; ``sha256:`` from the JSON key ``sha256`` of rank
        manifests written before BLAKE3; empty when unknown (never deduplicated against).
    """

    size: int
    crc32c: str
    object: str
    identity: str = ""


def _identity(stored: dict) -> str:
    """A stored file's identity from its JSON; rank manifests from before BLAKE3 hold ``"sha256": "<hex>"``."""
    if "identity" in stored:
        return str(stored["identity"])
    return f"sha256:{stored['sha256']}" if stored.get("sha256") else ""


@dataclasses.dataclass(frozen=True)
class RankManifest:
    """What one rank's backup of one step holds: a ``StepManifest`` plus where each file's bytes live.

    Attributes:
      step: the training step.
      rank: the node rank.
      files: relative posix path -> StoredFile.
      incarnation: the backup's tag (``BackupOrder.incarnation``: one per choice of a backup by the coordinator). A
        job that restores an older step and trains past it again writes the same step numbers anew, and a backup
        chosen after that has a tag of its own; ``COMMIT`` must never join ranks of two tags.
      timeline: the job's timeline the backup belongs to (part of its name).
    """

    step: int
    rank: int
    files: dict[str, StoredFile]
    incarnation: str = ""
    timeline: int = 0

    def step_manifest(self) -> StepManifest:
        """The checksums a restored copy must match."""
        return StepManifest(
            self.step, self.rank, {rel: (f.size, f.crc32c) for rel, f in self.files.items()}, self.timeline
        )

    def to_json(self) -> str:
        files = {rel: dataclasses.asdict(f) for rel, f in self.files.items()}
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "files": files,
                "incarnation": self.incarnation,
                "timeline": self.timeline,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "RankManifest":
        """Parses and validates a rank manifest.

        Raises:
          ValueError: not JSON, a field missing or of the wrong type, or a path that leaves the step.
        """
        try:
            raw = json.loads(text)
            files = {
                safe_relpath(rel): StoredFile(
                    int(f["size"]), str(f["crc32c"]), safe_relpath(str(f["object"])), _identity(f)
                )
                for rel, f in raw["files"].items()
            }
            return cls(
                int(raw["step"]), int(raw["rank"]), files, str(raw.get("incarnation", "")), int(raw.get("timeline", 0))
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed rank manifest: {exc!r}") from exc


def _job_prefix(job_key: str) -> str:
    namespace, _, job = job_key.partition("/")
    if not (DNS1123_LABEL.match(namespace) and DNS1123_LABEL.match(job)):
        raise ValueError(f"job key {job_key!r} is not <namespace>/<job> (DNS-1123 labels)")
    return f"{job_key}/steps/"


def _step_prefix(job_key: str, step: int, timeline: int = 0) -> str:
    if step < 0 or timeline < 0:
        raise ValueError(f"step {step} or timeline {timeline} is negative")
    return f"{_job_prefix(job_key)}{step}{f'-t{timeline}' if timeline else ''}/"


def _manifest_name(rank: int, share: bool = False) -> str:
    return f"rank-{rank}.share.json" if share else f"rank-{rank}.manifest.json"


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

    def upload_rank(
        self,
        job_key: str,
        step: int,
        rank: int,
        step_dir: str,
        manifest: StepManifest,
        dedup_from: RankManifest | None = None,
        incarnation: str = "",
        share: CpuShare | None = None,
        timeline: int = 0,
        on_file: Callable[[int], None] | None = None,
        group_share: bool = False,
    ) -> RankManifest:
        """Stores one rank's committed step, then its rank manifest.

        A file whose relative path, size and content identity equal a file of ``dedup_from`` (a rank manifest of
        the same step already stored, from ``rank_manifest``, typically a data-parallel peer's) is not
        uploaded: the new manifest names the peer's object, so identical data is stored once. CRC32C
        alone cannot tell such files apart (see ``file_identity``). The identity is computed in the
        scheme of the peer's file, so a peer's manifest from before BLAKE3 still deduplicates.

        Args:
          job_key: ``<namespace>/<job>``.
          step: the step.
          rank: the node rank whose data ``step_dir`` holds.
          step_dir: the committed step directory on this node.
          manifest: ``step_dir``'s checksums (``step_manifest.build_manifest``); every stored object is
            checked against them.
          dedup_from: a stored rank manifest of the same step, or None to upload everything.
          incarnation: the uploading job incarnation (see ``RankManifest``).
          share: the agent's CPU cap for computing content identities, or None.
          timeline: the job's timeline to store the step as (see the module's layout).
          on_file: called (from a worker thread) with each file's size in bytes once it is stored,
            or found stored already (a deduplicated file at once), or None.
          group_share: ``manifest`` holds only the files this rank uploads for its identical group
            (``shared_upload``): its manifest is stored as the rank's share, which commits nothing.

        Returns:
          The stored rank manifest (pass it as ``dedup_from`` for the next peer).

        Raises:
          ValueError: bad job key, ``manifest`` is for another step or rank, ``dedup_from`` is for
            another step, or a path in ``manifest`` leaves the step directory.
          BackupError: an upload failed or did not match ``manifest``; no rank manifest is written, so
            the step stays incomplete (``retain`` removes what was uploaded once a newer step commits).
            Or the step is committed already, with other data or by another incarnation: it is left alone.
          OSError: a local file could not be read.
        """
        prefix = _step_prefix(job_key, step, timeline)
        if (manifest.step, manifest.rank) != (step, rank):
            raise ValueError(f"manifest is for step {manifest.step} rank {manifest.rank}, not step {step} rank {rank}")
        if dedup_from is not None and (dedup_from.step, dedup_from.timeline) != (step, timeline):
            raise ValueError(
                f"dedup_from is for step {dedup_from.step} of timeline {dedup_from.timeline}, not {step} of "
                f"{timeline}: objects are shared within a step only"
            )
        if COMMIT in self.objects.list(prefix):
            if group_share:
                return RankManifest(step, rank, {}, incarnation, timeline)  # committed: nothing left to share
            return self._committed_as(job_key, step, rank, manifest, incarnation, timeline)
        peer = dedup_from.files if dedup_from is not None else {}
        files: dict[str, StoredFile] = {}
        uploads: list[Upload] = []
        with contextlib.ExitStack() as opened, pod_files.open_dir(step_dir) as root:
            for rel, (size, crc) in sorted(manifest.files.items()):
                same = peer.get(safe_relpath(rel))  # the path check guards the object name built from it
                # Opened without following links and read through /proc/self/fd: a file the pod
                # swaps for a symlink after the manifest was built cannot redirect the upload.
                fd = pod_files.open_relative(root, rel)
                opened.callback(os.close, fd)
                peer_scheme = same.identity.partition(":")[0] if same is not None else ""
                identity = file_identity(
                    fd, peer_scheme if peer_scheme in IDENTITY_SCHEMES else IDENTITY_SCHEME, share=share
                )
                if same is not None and (same.size, same.crc32c, same.identity) == (size, crc, identity):
                    files[rel] = same
                    if on_file is not None:
                        on_file(size)
                    continue
                files[rel] = StoredFile(size, crc, f"rank-{rank}/{rel}", identity)
                uploads.append(Upload(pod_files.proc_path(fd), prefix + files[rel].object, size, crc))
            self.objects.put_files(
                uploads, self.workers, None if on_file is None else lambda upload: on_file(upload.size)
            )
        stored = RankManifest(step, rank, files, incarnation, timeline)
        name = prefix + _manifest_name(rank, group_share)
        if (
            not self.objects.create_text(name, stored.to_json())
            and self.rank_manifest(job_key, step, rank, timeline, group_share) != stored
        ):
            # Left by an interrupted upload (another incarnation, or bytes since changed): the step is
            # not committed (checked above), and a rank's manifest has one writer per incarnation.
            self.objects.delete(name)
            if not self.objects.create_text(name, stored.to_json()):
                raise BackupError(f"{self.url}/{name}: written by another uploader meanwhile")
        return stored

    def _committed_as(
        self, job_key: str, step: int, rank: int, manifest: StepManifest, incarnation: str, timeline: int
    ) -> RankManifest:
        """The stored rank manifest of a committed ``step`` if it holds ``manifest``'s data from
        ``incarnation`` (a retried upload); raises ``BackupError`` otherwise."""
        stored = self.rank_manifest(job_key, step, rank, timeline)
        if stored is None or stored.incarnation != incarnation or stored.step_manifest().files != manifest.files:
            raise BackupError(
                f"{self.url}/{_step_prefix(job_key, step, timeline)} is committed with other data; "
                f"a committed step is never overwritten"
            )
        return stored

    def rank_manifest(
        self, job_key: str, step: int, rank: int, timeline: int = 0, group_share: bool = False
    ) -> RankManifest | None:
        """A stored rank manifest (``group_share``: the rank's share of its group's upload), or None
        when that rank's upload of ``step`` (of ``timeline``) has not finished.

        Raises:
          ValueError: bad job key.
          BackupError: the store failed, or the manifest is malformed.
        """
        name = _step_prefix(job_key, step, timeline) + _manifest_name(rank, group_share)
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
        self, job_key: str, step: int, nodes: int, incarnation: str | None = None, timeline: int = 0
    ) -> bool:
        """Writes ``COMMIT`` for ``step`` of ``timeline`` when the manifests of ranks ``0 .. nodes-1``
        all exist (and, with ``incarnation``, all come from that incarnation).

        Idempotent; safe to call from every node after its own upload.

        Returns:
          True if the step is committed (now or before), False while a rank manifest is missing.

        Raises:
          ValueError: bad job key, or ``nodes`` < 1.
          BackupError: the store failed.
        """
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, not {nodes}")
        prefix = _step_prefix(job_key, step, timeline)
        entries = set(self.objects.list(prefix))
        if COMMIT in entries:
            return True
        if any(_manifest_name(rank) not in entries for rank in range(nodes)):
            return False
        if incarnation is not None and any(
            getattr(self.rank_manifest(job_key, step, rank, timeline), "incarnation", None) != incarnation
            for rank in range(nodes)
        ):
            return False
        commit = {"step": step, "nodes": nodes, "ranks": list(range(nodes))}
        self.objects.create_text(prefix + COMMIT, json.dumps(commit, sort_keys=True))  # False: a peer was first
        return True

    def steps(self, job_key: str, partial: bool = False) -> dict[StepId, bool]:
        """Every (step, timeline) with anything stored -> whether it has ``COMMIT``.

        Args:
          job_key: ``<namespace>/<job>``.
          partial: also the steps that only have partial (multipart) uploads: one more listing of the store.

        Raises:
          ValueError: bad job key.
          BackupError: the store failed.
        """
        prefix = _job_prefix(job_key)
        entries = self.objects.list(prefix)
        if partial:
            entries += [n.split("/")[0] + "/" for n in self.objects.partial_uploads(prefix)]
        found = {(int(m[1]), int(m[2] or 0)) for entry in entries if (m := _STEP_ENTRY.match(entry))}
        return {
            (step, timeline): COMMIT in self.objects.list(_step_prefix(job_key, step, timeline))
            for step, timeline in found
        }

    def complete_steps(self, job_key: str) -> list[StepId]:
        """(step, timeline) of the steps with ``COMMIT``, ascending: the restorable ones.

        Raises:
          ValueError: bad job key.
          BackupError: the store failed.
        """
        return sorted(step for step, committed in self.steps(job_key).items() if committed)

    def committed_nodes(self, job_key: str, step: int, timeline: int = 0) -> int:
        """The number of nodes (rank manifests ``0 .. N-1``) of a committed step, from its ``COMMIT``.

        Raises:
          ValueError: bad job key.
          UnusableBackup: the step has no ``COMMIT``, or it is malformed.
          BackupError: the store failed.
        """
        name = _step_prefix(job_key, step, timeline) + COMMIT
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
        job_key: str,
        step: int,
        rank: int,
        dest_dir: str,
        workers: int = DEFAULT_WORKERS,
        timeline: int = 0,
        on_range: Callable[[int], None] | None = None,
    ) -> StepManifest:
        """Restores one rank's data of a committed step into ``dest_dir``, verified.

        Files are fetched as ranged reads of up to ``RANGE_BYTES`` (32 MiB), ``workers`` at a time,
        into a temporary sibling of ``dest_dir``, checked with ``verify_step``, and only then renamed
        to ``dest_dir``. On any failure nothing is left behind. Zero-byte files are recreated from the
        manifest alone.

        Args:
          job_key: ``<namespace>/<job>``.
          step: a step listed by ``complete_steps``.
          rank: the node rank.
          dest_dir: must not exist; its parent must. Files land at their relative paths below it.
          workers: concurrent ranged reads.
          timeline: the step's timeline (as ``complete_steps`` lists it).
          on_range: called (from a worker thread) with each range's length in bytes once it is written, or None.

        Returns:
          The manifest ``dest_dir`` was verified against.

        Raises:
          ValueError: bad job key.
          FileExistsError: ``dest_dir`` exists.
          BackupError: the step has no ``COMMIT``, the rank has no manifest, an object is missing or
            short, the data does not match its checksums, or the store failed.
          OSError: writing below ``dest_dir``'s parent failed (e.g. the ramdisk is full).
        """
        prefix = _step_prefix(job_key, step, timeline)
        if COMMIT not in self.objects.list(prefix):
            raise UnusableBackup(f"{self.url}/{prefix} has no {COMMIT}: step {step} is not restorable")
        stored = self.rank_manifest(job_key, step, rank, timeline)
        if stored is None:
            raise UnusableBackup(f"{self.url}/{prefix} has {COMMIT} but no manifest for rank {rank}")
        if os.path.lexists(dest_dir):
            raise FileExistsError(f"{dest_dir} exists")
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
            run_parallel(functools.partial(self._fetch_range, on_range=on_range), ranges, workers)
            manifest = stored.step_manifest()
            check_step(
                tmp, manifest, f"{self.url}/{prefix} rank {rank}", unusable=UnusableBackup, corrupt=CorruptBackup
            )
            os.rename(tmp, dest_dir)
            return manifest
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _fetch_range(self, item: tuple[str, str, int, int], on_range: Callable[[int], None] | None) -> None:
        name, path, start, length = item
        fd = os.open(path, os.O_WRONLY)
        try:
            self.objects.download_range(name, start, length, fd)
        finally:
            os.close(fd)
        if on_range is not None:
            on_range(length)

    def delete_step(self, job_key: str, step: int, timeline: int = 0) -> None:
        """Deletes everything stored for ``step`` of ``timeline``: ``COMMIT`` first, then rank
        manifests, then data, then partial uploads.

        Raises:
          ValueError: bad job key.
          BackupError: the store failed; what remains is an incomplete step.
        """
        prefix = _step_prefix(job_key, step, timeline)
        names = self.objects.list(prefix, recursive=True)
        if COMMIT in names:
            self.objects.delete(prefix + COMMIT)
        manifests = [prefix + n for n in names if _MANIFEST_NAME.match(n)]
        data = [prefix + n for n in names if n != COMMIT and not _MANIFEST_NAME.match(n)]
        run_parallel(self.objects.delete, manifests, self.workers)
        run_parallel(self.objects.delete, data, self.workers)
        self.objects.abort_partial_uploads(prefix)

    def retain(
        self, job_key: str, keep: int, protected: Iterable[int] = (), forks: tuple[int, ...] = ()
    ) -> list[StepId]:
        """Garbage-collects a job's backups.

        Deletes every step of an abandoned timeline (``messages.abandoned``). Of the others, keeps the
        newest ``keep`` complete steps and every protected step; deletes the other complete steps, and
        the incomplete steps older than the newest complete one (interrupted uploads, including their
        partial multipart uploads). Incomplete steps newer than it may still be uploading and are kept.

        Args:
          job_key: ``<namespace>/<job>``.
          keep: complete steps to keep, >= 1.
          protected: steps never deleted (e.g. one a restore is reading), unless abandoned.
          forks: the job's rollbacks (``BackupOrder.forks``).

        Returns:
          The deleted (step, timeline) pairs, ascending.

        Raises:
          ValueError: bad job key, or ``keep`` < 1.
          BackupError: the store failed.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        protected = set(protected)
        steps = self.steps(job_key, partial=True)
        doomed = {s for s in steps if abandoned(forks, *s)}
        complete = sorted(s for s, committed in steps.items() if committed and s not in doomed)
        if complete:
            newest = complete[-1][0]
            doomed |= {s for s in complete[:-keep] if s[0] not in protected}
            doomed |= {s for s, committed in steps.items() if not committed and s[0] < newest and s[0] not in protected}
        deleted = sorted(doomed)
        for step, timeline in deleted:
            self.delete_step(job_key, step, timeline)
        return deleted
