"""Per-file checksums of a committed step: what every tier verifies before data reaches Orbax.

A manifest is JSON ``{"step": S, "rank": R, "files": {"<relative posix path>": [size, "<crc32c hex>"]}}``;
CRC32C is the checksum GCS uses, so one value serves the peer and the backup tiers.
"""

import dataclasses
import hashlib
import json
import os

import google_crc32c

_CHUNK_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """Checksums of one rank's data for one step.

    Attributes:
      step: the training step.
      rank: the node rank whose data the directory holds.
      files: relative posix path -> (size bytes, CRC32C as 8 hex digits).
    """

    step: int
    rank: int
    files: dict[str, tuple[int, str]]

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "rank": self.rank, "files": self.files}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "StepManifest":
        raw = json.loads(text)
        return cls(int(raw["step"]), int(raw["rank"]), {p: (int(s), str(c)) for p, (s, c) in raw["files"].items()})


def safe_relpath(path: str) -> str:
    """Checks that ``path`` names a file strictly inside a directory (a manifest key, an object name).

    Returns:
      ``path`` unchanged.

    Raises:
      ValueError: empty, absolute, or with an empty, ``.`` or ``..`` component, a backslash or a NUL.
    """
    if not path or "\\" in path or "\0" in path or any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"{path!r} is not a relative path inside a step")
    return path


def file_crc32c(path: str) -> str:
    """CRC32C of a file's bytes, as 8 lowercase hex digits; reads in 4 MiB chunks."""
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            checksum.update(chunk)
    return checksum.digest().hex()


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes, hex; reads in 4 MiB chunks.

    For content identity, where CRC32C cannot serve: OCDBT files end with their own CRC32C, so the
    CRC32C of every whole OCDBT file is the same constant (the CRC residue, ``48674bc7``).
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _walk_files(step_dir: str):
    for directory, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(directory, name)
            yield os.path.relpath(path, step_dir).replace(os.sep, "/"), path


def build_manifest(step_dir: str, step: int, rank: int) -> StepManifest:
    """Checksums every regular file under ``step_dir``.

    Raises:
      OSError: a file vanished or could not be read.
    """
    return StepManifest(step, rank, {rel: (os.path.getsize(p), file_crc32c(p)) for rel, p in sorted(_walk_files(step_dir))})


def verify_step(step_dir: str, manifest: StepManifest) -> list[str]:
    """Compares ``step_dir`` with ``manifest``.

    Returns:
      One line per problem (missing, unexpected, wrong size, checksum mismatch); empty when intact.
    """
    found = dict(_walk_files(step_dir))
    problems = [f"unexpected file {rel}" for rel in sorted(set(found) - set(manifest.files))]
    for rel, (size, crc) in sorted(manifest.files.items()):
        path = found.get(rel)
        if path is None:
            problems.append(f"missing file {rel}")
        elif os.path.getsize(path) != size:
            problems.append(f"{rel}: {os.path.getsize(path)} bytes, expected {size}")
        elif file_crc32c(path) != crc:
            problems.append(f"{rel}: crc32c mismatch")
    return problems
