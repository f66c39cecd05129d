"""Per-file checksums of a committed step: what every tier verifies before data reaches Orbax.

A manifest is JSON ``{"step": S, "rank": R, "timeline": T, "files": {"<relative posix path>": [size, "<crc32c hex>"]}}``
(``timeline`` absent means 0: see ``messages.in_lineage``);
CRC32C is the checksum GCS uses, so one value serves the peer and the backup tiers.
"""

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import os
from collections.abc import Iterator

import blake3
from awscrt import checksums

from replicator.local_tier import pod_files
from replicator.pacing.cpu_share import CpuShare


class UnusableCopy(Exception):
    """Mixed into the errors that prove a copy of a step cannot serve: its holder no longer has it,
    its files are not those of its manifest, or it fails its checksums (``CorruptCopy``). Every
    other failure (a refused connection, a timeout, a store outage) is transient: the copy is
    retried, never excluded for it."""


class CorruptCopy(UnusableCopy):
    """A copy whose bytes fail their checksums: a file's CRC-32C differs from the manifest's, or the
    manifest it was verified against differs from the checksums its owning rank reported. What
    ``mtc_corrupt_copies_total`` counts."""


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """Checksums of one rank's data for one step.

    Attributes:
      step: the training step.
      rank: the node rank whose data the directory holds.
      files: relative posix path -> (size bytes, CRC32C as 8 hex digits).
      timeline: the job's timeline the step was written in (after how many rollbacks).
    """

    step: int
    rank: int
    files: dict[str, tuple[int, str]]
    timeline: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> str:
        return json.dumps(
            {"step": self.step, "rank": self.rank, "timeline": self.timeline, "files": self.files}, sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str) -> "StepManifest":
        raw = json.loads(text)
        files = {p: (int(s), str(c)) for p, (s, c) in raw["files"].items()}
        return cls(int(raw["step"]), int(raw["rank"]), files, int(raw.get("timeline", 0)))


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


# Reads of 2 MiB into one reused buffer: still in the CPU cache when the checksum reads them back (8 MiB
# reads run at half the speed: the copy spills to RAM), and no fresh pages to fault in for each read.
_READ_BYTES = 2 << 20
_PIECE_BYTES = 64 << 20  # a large file is checksummed as pieces on several threads, then combined
_OPEN_AT_ONCE = 64  # descriptors a step walk holds at once, far below the usual limit of 1024
_CRC32C_POLY = 0x82F63B78  # reflected


def _multiply_mod_poly(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32C polynomial, both as reflected 32-bit values."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    """x^(2^n) modulo the polynomial, n = 0..31."""
    table = [1 << 30]  # x^1
    while len(table) < 32:
        table.append(_multiply_mod_poly(table[-1], table[-1]))
    return table


_X_POW_2N = _powers_of_x()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length in bytes
    (zlib's ``crc32_combine`` with the Castagnoli polynomial): lets pieces of a file be checksummed
    apart, on several threads or as they arrive, and still give the file's CRC-32C."""
    shift, n, k = 1 << 31, len2, 3  # x^0; x^(8 * len2) = product of x^(2^k) over the set bits of len2, from k = 3
    while n:
        if n & 1:
            shift = _multiply_mod_poly(_X_POW_2N[k & 31], shift)
        n >>= 1
        k += 1
    return _multiply_mod_poly(shift, crc1) ^ crc2


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """The CRC-32C (Castagnoli, as in the manifest and in GCS's and S3's object checksums) of the bytes
    checksummed into ``crc`` followed by ``data``; 0 is the CRC-32C of no bytes.

    awscrt's (a dependency already, through boto3[crt]): it takes any bytes-like object, so reads go into
    reused buffers, it releases the GIL, so threads checksum at once, and it runs at about 2.4 times
    google_crc32c's speed on this machine's CPUs (13 against 5.3 GiB/s on one core, in memory).
    """
    return checksums.crc32c(data, crc)


def _chunks(fd: int, start: int = 0, end: int | None = None, share: CpuShare | None = None) -> Iterator[memoryview]:
    """Bytes [start, end) of an open file (to its end when ``end`` is None), in reads of ``_READ_BYTES``,
    pausing after each for ``share`` when given. Each is a view of one reused buffer: valid until the
    next is asked for. (Not ``mmap``: a file truncated under the mapping would kill the agent with
    SIGBUS, and the pod can truncate its own files.)

    Raises:
      OSError: the file ends before ``end`` (it changed while being read), or a read failed.
    """
    buffer = memoryview(bytearray(_READ_BYTES if end is None else min(_READ_BYTES, end - start)))
    offset = start
    while end is None or offset < end:
        read = os.preadv(fd, [buffer if end is None else buffer[: end - offset]], offset)
        if not read:
            if end is None:
                return
            raise OSError(errno.EIO, f"file ended at byte {offset} of {end} while being read: it changed")
        yield buffer[:read]
        offset += read
        if share is not None:
            share.pause()


def _crc32c_of_range(fd: int, start: int, end: int, share: CpuShare | None = None) -> int:
    """CRC-32C of bytes [start, end) of an open file; raises OSError as ``_chunks``."""
    crc = 0
    for chunk in _chunks(fd, start, end, share):
        crc = crc32c_extend(crc, chunk)
    return crc


def checksum_files(
    files: list[tuple[str, int]], workers: int | None = None, share: CpuShare | None = None
) -> dict[str, tuple[int, str]]:
    """Sizes and CRC32Cs of many open files at once: files larger than 64 MiB are cut into 64 MiB
    pieces, the pieces spread over ``workers`` threads, and each file's CRC combined from its pieces.

    Args:
      files: (key, descriptor open for reading) pairs; the caller closes them.
      workers: threads; None for one per CPU.
      share: the agent's CPU cap while a job trains (replication), or None to use every core (restore).

    Returns:
      key -> (size bytes as ``fstat`` gives it, CRC32C as 8 lowercase hex digits).

    Raises:
      OSError: a read failed, or a file shrank while being read.
    """
    fds = dict(files)
    sizes = {key: os.fstat(fd).st_size for key, fd in fds.items()}
    pieces = [
        (key, start, min(start + _PIECE_BYTES, size))
        for key, size in sizes.items()
        for start in range(0, size, _PIECE_BYTES)
    ]
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        crcs = list(pool.map(lambda piece: _crc32c_of_range(fds[piece[0]], piece[1], piece[2], share), pieces))
    combined = dict.fromkeys(fds, 0)  # 0 is the CRC-32C of no bytes
    for (key, start, end), crc in zip(pieces, crcs):  # a file's pieces are in offset order
        combined[key] = crc32c_combine(combined[key], crc, end - start)
    return {key: (sizes[key], f"{combined[key]:08x}") for key in fds}


IDENTITY_SCHEME = "blake3"
IDENTITY_SCHEMES = ("blake3", "sha256")


def file_identity(fd: int, scheme: str = IDENTITY_SCHEME, threads: int = 1, share: CpuShare | None = None) -> str:
    """The content identity of an open file that deduplication compares: ``"<scheme>:<hex digest>"``.

    For content identity, where CRC32C cannot serve: OCDBT files end with their own CRC32C, so the
    CRC32C of every whole OCDBT file is the same constant (the CRC residue, ``48674bc7``). BLAKE3 is
    the default (about twice SHA-256's speed on one core with SHA-NI, more on several threads);
    ``"sha256"`` is still computed on request, to compare with the identities of backups written
    before BLAKE3.

    Args:
      fd: an open regular file, read from offset 0 to its end.
      scheme: ``"blake3"`` or ``"sha256"``.
      threads: BLAKE3 hashes each read on this many threads (SHA-256 is sequential).
      share: the agent's CPU cap, or None.

    Raises:
      ValueError: an unknown scheme.
      OSError: a read failed.
    """
    if scheme not in IDENTITY_SCHEMES:
        raise ValueError(f"unknown content identity scheme {scheme!r}")
    digest = blake3.blake3(max_threads=threads) if scheme == "blake3" else hashlib.sha256()
    for chunk in _chunks(fd, share=share):
        digest.update(chunk)
    return f"{scheme}:{digest.hexdigest()}"


def _checksums(step_dir: str, share: CpuShare | None = None) -> dict[str, tuple[int, str]]:
    """relative path -> (size, CRC32C) of every regular file, walked without following any link
    (``pod_files``): a planted symlink, FIFO or device raises instead of being read. Files are
    checksummed ``_OPEN_AT_ONCE`` at a time with ``checksum_files``."""
    found: dict[str, tuple[int, str]] = {}
    with pod_files.open_dir(step_dir) as root:
        walk = pod_files.walk_files(root)
        while True:
            with contextlib.ExitStack() as opened:
                batch = []
                for rel, dir_fd, name, _ in itertools.islice(walk, _OPEN_AT_ONCE):
                    batch.append((rel, pod_files.open_regular(dir_fd, name)))
                    opened.callback(os.close, batch[-1][1])
                if not batch:
                    return found
                found.update(checksum_files(batch, share=share))


def build_manifest(
    step_dir: str, step: int, rank: int, share: CpuShare | None = None, timeline: int = 0
) -> StepManifest:
    """Checksums every regular file under ``step_dir`` (see ``checksum_files`` for ``share``); the
    manifest is tagged with ``timeline``.

    Raises:
      pod_files.UnsafeEntry: the step holds something other than regular files and directories.
      OSError: a file vanished or could not be read.
      ValueError: the step holds no file at all (a vanished or empty directory proves nothing).
    """
    files = _checksums(step_dir, share)
    if not files:
        raise ValueError(f"{step_dir} holds no files")
    return StepManifest(step, rank, files, timeline)


def _problems(
    step_dir: str, manifest: StepManifest, share: CpuShare | None = None
) -> list[tuple[type[UnusableCopy], str]]:
    """What ``verify_step`` finds, each line with its kind: ``CorruptCopy`` for a checksum mismatch,
    ``UnusableCopy`` for the rest."""
    if not manifest.files:
        return [(UnusableCopy, "the manifest lists no files")]
    try:
        found = _checksums(step_dir)
    except OSError as err:
        return [(UnusableCopy, f"unreadable: {err}")]
    problems = [(UnusableCopy, f"unexpected file {rel}") for rel in sorted(set(found) - set(manifest.files))]
    for rel, (size, crc) in sorted(manifest.files.items()):
        if rel not in found:
            problems.append((UnusableCopy, f"missing file {rel}"))
        elif found[rel][0] != size:
            problems.append((UnusableCopy, f"{rel}: {found[rel][0]} bytes, expected {size}"))
        elif found[rel][1] != crc:
            problems.append((CorruptCopy, f"{rel}: crc32c mismatch"))
    return problems


def verify_step(step_dir: str, manifest: StepManifest, share: CpuShare | None = None) -> list[str]:
    """Compares ``step_dir`` with ``manifest``, walking it as ``build_manifest`` does (see
    ``checksum_files`` for ``share``).

    Returns:
      One line per problem (missing, unexpected, wrong size, checksum mismatch, an entry that is not
      a regular file or directory, an empty manifest); empty when intact.
    """
    return [line for _, line in _problems(step_dir, manifest, share)]


def check_step(
    step_dir: str,
    manifest: StepManifest,
    what: str,
    share: CpuShare | None = None,
    unusable: type[UnusableCopy] = UnusableCopy,
    corrupt: type[CorruptCopy] = CorruptCopy,
) -> None:
    """``verify_step`` as an error: raises unless ``step_dir`` matches ``manifest``.

    Args:
      what: names the copy at the start of the message.
      unusable, corrupt: the tier's classes of the two kinds (e.g. the backup tier's, which are
        also its ``BackupError``).

    Raises:
      corrupt: a file fails its checksum (the message lists the first five problems).
      unusable: the step's files are not those of ``manifest`` otherwise (missing, unexpected, of
        another size, unreadable, not regular files).
    """
    problems = _problems(step_dir, manifest, share)
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        kind = corrupt if any(k is CorruptCopy for k, _ in problems) else unusable
        raise kind(f"{what} does not match its manifest: {'; '.join(line for _, line in problems[:5])}{more}")
