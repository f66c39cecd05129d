"""The backup tier's step layout: object names below the store's prefix and the rank manifests.

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

import dataclasses
import json
import re

from csi_driver.volume_request import DNS1123_LABEL
from replicator.backup_tier.object_store import BackupError
from replicator.local_tier.step_manifest import CorruptCopy, StepManifest, UnusableCopy, safe_relpath
from replicator.wire.messages import JobRef

COMMIT = "COMMIT"
MANIFEST_NAME = re.compile(r"^rank-(\d+)\.manifest\.json$")
STEP_ENTRY = re.compile(r"^(0|[1-9][0-9]*)(?:-t([1-9][0-9]*))?/$")
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


def job_prefix(job: JobRef) -> str:
    """The job's steps' prefix, ``<namespace>/<job>/steps/``.

    Raises:
      ValueError: the namespace or job is not a DNS-1123 label.
    """
    if not (DNS1123_LABEL.match(job.namespace) and DNS1123_LABEL.match(job.job)):
        raise ValueError(f"job key {str(job)!r} is not <namespace>/<job> (DNS-1123 labels)")
    return f"{job}/steps/"


def step_prefix(job: JobRef, step: int, timeline: int = 0) -> str:
    """A step's prefix: ``<namespace>/<job>/steps/<step>[-t<timeline>]/``.

    Raises:
      ValueError: as ``job_prefix``, or a negative step or timeline.
    """
    if step < 0 or timeline < 0:
        raise ValueError(f"step {step} or timeline {timeline} is negative")
    return f"{job_prefix(job)}{step}{f'-t{timeline}' if timeline else ''}/"


def manifest_name(rank: int, share: bool = False) -> str:
    """The name of a rank's manifest (``share``: of its share of a group's upload) in its step's directory."""
    return f"rank-{rank}.share.json" if share else f"rank-{rank}.manifest.json"
