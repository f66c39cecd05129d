"""Per-file checksums of a committed step: what every tier verifies before data reaches Orbax.

A manifest is JSON ``{"step": S, "rank": R, "files": {"<relative posix path>": [size, "<crc32c hex>"]}}``;
CRC32C is the checksum GCS uses, so one value serves the peer and the backup tiers.
"""

import dataclasses
import hashlib
import json
import os

import google_crc32c

from replicator import pod_files

_CHUNK_BYTES = 4 << 20


class UnusableCopy(Exception):
    """Mixed into the errors that prove a copy of a step cannot serve: it fails its checksums, or its
    holder no longer has it. Every other failure (a refused connection, a timeout, a store outage)
    is transient: the copy is retried, never excluded for it."""


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


def _crc32c_fd(fd: int) -> str:
    checksum = google_crc32c.Checksum()
    while chunk := os.read(fd, _CHUNK_BYTES):
        checksum.update(chunk)
    return checksum.digest().hex()


def file_crc32c(path: str) -> str:
    """CRC32C of a file's bytes, as 8 lowercase hex digits; reads in 4 MiB chunks."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _crc32c_fd(fd)
    finally:
        os.close(fd)


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


def _checksums(step_dir: str) -> dict[str, tuple[int, str]]:
    """relative path -> (size, CRC32C) of every regular file, walked without following any link
    (``pod_files``): a planted symlink, FIFO or device raises instead of being read."""
    found = {}
    with pod_files.open_dir(step_dir) as root:
        for rel, dir_fd, name, _ in pod_files.walk_files(root):
            fd = pod_files.open_regular(dir_fd, name)
            try:
                found[rel] = (os.fstat(fd).st_size, _crc32c_fd(fd))
            finally:
                os.close(fd)
    return found


def build_manifest(step_dir: str, step: int, rank: int) -> StepManifest:
    """Checksums every regular file under ``step_dir``.

    Raises:
      pod_files.UnsafeEntry: the step holds something other than regular files and directories.
      OSError: a file vanished or could not be read.
      ValueError: the step holds no file at all (a vanished or empty directory proves nothing).
    """
    files = _checksums(step_dir)
    if not files:
        raise ValueError(f"{step_dir} holds no files")
    return StepManifest(step, rank, files)


def verify_step(step_dir: str, manifest: StepManifest) -> list[str]:
    """Compares ``step_dir`` with ``manifest``, walking it as ``build_manifest`` does.

    Returns:
      One line per problem (missing, unexpected, wrong size, checksum mismatch, an entry that is not
      a regular file or directory, an empty manifest); empty when intact.
    """
    if not manifest.files:
        return ["the manifest lists no files"]
    try:
        found = _checksums(step_dir)
    except OSError as err:
        return [f"unreadable: {err}"]
    problems = [f"unexpected file {rel}" for rel in sorted(set(found) - set(manifest.files))]
    for rel, (size, crc) in sorted(manifest.files.items()):
        if rel not in found:
            problems.append(f"missing file {rel}")
        elif found[rel][0] != size:
            problems.append(f"{rel}: {found[rel][0]} bytes, expected {size}")
        elif found[rel][1] != crc:
            problems.append(f"{rel}: crc32c mismatch")
    return problems
