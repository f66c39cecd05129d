"""Checksumming a step: the manifest's CRC-32C and the backup tier's dedup identity, each beside its baseline.

A 1 GiB step (8 files of 128 MiB, random bytes) sits on a tmpfs, as a committed step does on the ramdisk.

- manifest: ``build_manifest`` of the step (every file read with ``pread`` and checksummed, in 64 MiB
  pieces on K threads, K = CPUs), against ``google_crc32c.value`` over the same bytes already in
  memory on one thread: the checksum alone, with no file to read, is the limit of one core. Goal >= 0.8.
  A second row sets it against the CRC-32C the manifest itself uses (awscrt's, ``crc32c_extend``) over
  the same bytes in memory on one thread, the faster limit on this machine.
- backup_identity: ``file_identity`` (BLAKE3) of every file, on 1 thread and on K threads, against the
  identity before BLAKE3: SHA-256 of the same files through the same reader. Goal >= 3x faster. A
  last row compares the two hashes alone on one thread over bytes in memory: the most BLAKE3 can
  gain over SHA-256 on this CPU (SHA-256 has SHA-NI here; BLAKE3 uses AVX2, or AVX-512 where present).

Each repetition runs every path once, rotating which goes first; ratios are medians of the
per-repetition ratios. Run as root: ``python -m tests.bench.step_checksums``.
"""

import hashlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import blake3
import google_crc32c

from examples.local_cluster import scratch_dir
from replicator.local_tier.step_manifest import build_manifest, crc32c_extend, file_identity

GiB = 1 << 30
MiB = 1 << 20
FILES = 8
FILE_SIZE = 128 * MiB
REPETITIONS = 7
GOAL_MANIFEST, GOAL_IDENTITY = 0.8, 3.0
CORES = os.cpu_count() or 1


def identities(step_dir: str, scheme: str, threads: int) -> list[str]:
    """The identity of every file of ``step_dir``."""
    found = []
    for name in sorted(os.listdir(step_dir)):
        fd = os.open(os.path.join(step_dir, name), os.O_RDONLY)
        try:
            found.append(file_identity(fd, scheme, threads))
        finally:
            os.close(fd)
    return found


def measure(paths: dict[str, Callable[[], object]]) -> list[dict[str, float]]:
    """REPETITIONS samples (GiB/s per path) after one untimed warm-up of each, rotating which goes first."""
    order = list(paths)
    for name in order:
        paths[name]()
    samples = []
    for rep in range(REPETITIONS):
        sample = {}
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            start = time.perf_counter()
            paths[name]()
            sample[name] = FILES * FILE_SIZE / GiB / (time.perf_counter() - start)
        samples.append(sample)
    return samples


def report(samples: list[dict[str, float]]) -> None:
    def row(label: str, ours: str, base: str, goal: float) -> None:
        ratio = statistics.median(s[ours] / s[base] for s in samples)
        median = lambda name: statistics.median(s[name] for s in samples)  # noqa: E731
        print(
            f"{label:<34}{median(ours):>10.2f}{median(base):>11.2f}{ratio:>9.2f}  >= {goal} {'PASS' if ratio >= goal else 'BELOW'}"
        )

    print(f"{'operation':<34}{'ours GiB/s':>10}{'base GiB/s':>11}{'ratio':>9}  goal")
    row(f"manifest ({CORES} threads) vs crc in memory", "manifest", "crc32c in memory", GOAL_MANIFEST)
    row("  the same vs awscrt's crc in memory", "manifest", "awscrt crc32c in memory", GOAL_MANIFEST)
    row("backup_identity blake3 1 thread", "blake3 1 thread", "sha256", GOAL_IDENTITY)
    row(f"backup_identity blake3 {CORES} threads", f"blake3 {CORES} threads", "sha256", GOAL_IDENTITY)
    row("hashes alone, in memory", "blake3 in memory", "sha256 in memory", GOAL_IDENTITY)
    print(
        f"medians of {REPETITIONS} repetitions; ratios are medians of per-repetition ratios. {FILES} files of "
        f"{FILE_SIZE // MiB} MiB on tmpfs; baselines: google_crc32c.value (and awscrt's) over the same bytes in memory (1 thread), "
        f"SHA-256 of the same files (the identity before BLAKE3). {CORES} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )


def main() -> None:
    with scratch_dir("mtc-bench-sums-") as (workdir, _):
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={FILES * FILE_SIZE + 64 * MiB}", "mtc-bench-sums", workdir],
            check=True,
        )
        contents = [os.urandom(FILE_SIZE) for _ in range(FILES)]
        for i, data in enumerate(contents):
            with open(os.path.join(workdir, f"shard-{i}.bin"), "wb") as f:
                f.write(data)
        manifest = build_manifest(workdir, 0, 0)
        if sorted(crc for _, crc in manifest.files.values()) != sorted(
            f"{google_crc32c.value(d):08x}" for d in contents
        ):
            raise RuntimeError("build_manifest disagrees with google_crc32c")
        report(
            measure(
                {
                    "manifest": lambda: build_manifest(workdir, 0, 0),
                    "crc32c in memory": lambda: [google_crc32c.value(data) for data in contents],
                    "awscrt crc32c in memory": lambda: [crc32c_extend(0, data) for data in contents],
                    "blake3 1 thread": lambda: identities(workdir, "blake3", 1),
                    f"blake3 {CORES} threads": lambda: identities(workdir, "blake3", CORES),
                    "sha256": lambda: identities(workdir, "sha256", 1),
                    "blake3 in memory": lambda: [blake3.blake3(data).digest() for data in contents],
                    "sha256 in memory": lambda: [hashlib.sha256(data).digest() for data in contents],
                }
            )
        )


if __name__ == "__main__":
    main()
