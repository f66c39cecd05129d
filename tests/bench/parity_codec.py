"""The erasure codes of ``xor:N`` / ``rs:N:K`` redundancy on one core, and the cluster RAM they cost.

- memcpy: ``numpy.copyto`` of a 64 MiB buffer, the machine's memory bandwidth on one core: the baseline.
- encode: one stripe's parity with the product's codec (``replicator.parity.codec``: XOR in numpy,
  Reed-Solomon through pyeclib's ISA-L Cauchy code) from ``N - K`` segments of 4 MiB, on one thread, for
  XOR(4) (3 data), XOR(8) (7 data) and RS(8,2) (6 data). Throughput is input bytes (the data segments) per
  second, set against memcpy's.
- rebuild: the same stripes with one data segment lost (XOR) or two (RS), rebuilt from ``N - K`` of the
  others as the decoder hands them over (the surviving data segments, then parity); throughput is the bytes
  of the ``N - K`` shards read per second.
- allocator: each codec call allocates its output (numpy's arrays, pyeclib's fragments: 4 MiB each). Where
  glibc serves them from a heap it keeps (``M_MMAP_THRESHOLD`` 32 MiB, trim threshold 512 MiB) they are
  warm pages; where it maps and unmaps them per call (its default 128 KiB thresholds, which its dynamic
  threshold leaves in place for blocks just above any block freed so far) every call faults in fresh zeroed
  pages. Both are measured (``mallopt``), as two columns: which one a long-lived agent sees depends on its
  allocation history, and here it moves RS(8,2)'s encode several-fold.
- cluster RAM per unit of checkpoint: full replicas cost ``1 + replicas``; for the codes, a group's streams
  (N members of 64 MiB each, then of sizes spread evenly over 64 MiB +- 10 %) are encoded stripe by stripe
  with the product's layout (``GroupLayout``: zero padding to the longest, ``segment_bytes`` rounded to words)
  in 4 MiB chunks, as the encoder does, and the parity bytes it produces are counted: (streams + shards) /
  streams. Goal: XOR(N) within 5 % of SCR's N/(N-1). RS(N,K) is shown beside its 1 + K/(N-K), with no goal.

Each repetition times every path once, rotating which goes first; rates are medians over the repetitions,
ratios medians of the per-repetition ratios. Every code is checked (rebuilt bytes equal) before it is timed.
Needs no root: ``python -m tests.bench.parity_codec``.
"""

import argparse
import ctypes
import ctypes.util
import os
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version

import numpy as np

from replicator.parity.codec import Codec, codec
from replicator.parity.layout import GroupLayout, cluster_ram

MiB = 1 << 20
GB = 1e9
COPY_BYTES = 64 * MiB
SEGMENT_BYTES = 4 * MiB
STREAM_BYTES = 64 * MiB
CHUNK_BYTES = 4 * MiB  # the encoder's chunk (replicator/parity/encoder.py)
MIN_SAMPLE_SECONDS = 0.15  # each timed sample repeats its call at least this long
GOAL_XOR_RAM = 0.05  # XOR(N) within 5 % of N/(N-1)
CODES = [("XOR(4)", 4, 1), ("XOR(8)", 8, 1), ("RS(8,2)", 8, 2)]
REPLICAS = [1, 2]
MODES = ("reused", "fresh")  # the allocator's: a heap kept warm, or pages mapped and unmapped per call
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def allocator(mode: str) -> bool:
    """Sets glibc's thresholds for ``mode``; False where this libc has no ``mallopt`` (not glibc)."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    mmap, trim = (32 * MiB, 512 * MiB) if mode == "reused" else (128 << 10, 128 << 10)
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))


def timed(call: Callable[[], object], nbytes: int) -> float:
    """Bytes per second of ``call`` (``nbytes`` each), repeated for at least MIN_SAMPLE_SECONDS after one untimed
    call (the allocator's pages for the mode just set)."""
    call()
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_SAMPLE_SECONDS:
            return calls * nbytes / elapsed


def measure(
    paths: dict[tuple[str, str], tuple[Callable[[], object], int]], repetitions: int
) -> list[dict[tuple[str, str], float]]:
    """``repetitions`` samples (bytes/s per (path, allocator mode)), rotating which goes first."""
    order = list(paths)
    samples = []
    for rep in range(repetitions):
        sample = {}
        for name, mode in order[rep % len(order) :] + order[: rep % len(order)]:
            allocator(mode)
            call, nbytes = paths[(name, mode)]
            sample[(name, mode)] = timed(call, nbytes)
        samples.append(sample)
    allocator("reused")
    return samples


def stripe(code: Codec, seed: int) -> tuple[list[bytes], list[bytes]]:
    """``code.data`` random segments of SEGMENT_BYTES and their parity shards."""
    rng = np.random.default_rng(seed)
    segments = [rng.integers(0, 256, SEGMENT_BYTES, dtype=np.uint8).tobytes() for _ in range(code.data)]
    return segments, code.encode(segments)


def rebuild_call(code: Codec, segments: list[bytes], parity: list[bytes]) -> tuple[Callable[[], object], list[int]]:
    """The rebuild of the first ``code.parity`` data segments from the others, checked once."""
    lost = list(range(code.parity))
    shards = {i: s for i, s in enumerate(segments) if i not in lost}
    shards.update({code.data + j: p for j, p in enumerate(parity)})
    chosen = {i: shards[i] for i in sorted(shards)[: code.data]}  # data first, then parity, as the decoder does
    rebuilt = code.rebuild(chosen, lost)
    if rebuilt != {i: segments[i] for i in lost}:
        raise RuntimeError(f"{type(code).__name__}({code.data}+{code.parity}) rebuilt wrong bytes")
    return (lambda: code.rebuild(chosen, lost)), lost


def throughput(repetitions: int) -> None:
    src = np.random.default_rng(0).integers(0, 256, COPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    calls: dict[str, tuple[Callable[[], object], int]] = {"memcpy": (lambda: np.copyto(dst, src), COPY_BYTES)}
    labels = {"memcpy": f"memcpy (numpy copyto, {COPY_BYTES // MiB} MiB)"}
    for seed, (name, n, k) in enumerate(CODES):
        code = codec(n - k, k)
        segments, parity = stripe(code, seed + 1)
        stripe_bytes = code.data * SEGMENT_BYTES
        calls[f"encode {name}"] = ((lambda c=code, s=segments: c.encode(s)), stripe_bytes)
        labels[f"encode {name}"] = f"encode {name}, {n - k} data"
        rebuild, lost = rebuild_call(code, segments, parity)
        calls[f"rebuild {name}"] = (rebuild, stripe_bytes)
        labels[f"rebuild {name}"] = f"rebuild {name}, {len(lost)} lost"
    modes = MODES if allocator("fresh") else MODES[:1]
    allocator("reused")
    paths = {
        (name, mode): call for name, call in calls.items() for mode in modes if name != "memcpy" or mode == MODES[0]
    }
    samples = measure(paths, repetitions)

    def cells(name: str, mode: str) -> str:
        if (name, mode) not in paths:
            return f"{'-':>8} {'-':>9}"
        rate = statistics.median(s[(name, mode)] for s in samples) / GB
        ratio = statistics.median(s[(name, mode)] / s[("memcpy", MODES[0])] for s in samples)
        return f"{rate:>8.2f} {ratio:>9.2f}"

    print(
        f"== codec throughput, one thread, {SEGMENT_BYTES // MiB} MiB segments"
        f" (medians of {repetitions} repetitions; GB = 1e9 bytes)"
    )
    print(f"  {'':<38} {'heap reused':>18}   {'fresh pages':>18}")
    print(f"  {'figure':<38} {'GB/s':>8} {'x memcpy':>9}   {'GB/s':>8} {'x memcpy':>9}   goal  verdict")
    for name in calls:
        print(f"  {labels[name]:<38} {cells(name, MODES[0])}   {cells(name, MODES[1])}   -     -")
    print(
        "  encode: data segment bytes per second; rebuild: bytes of the n - k shards read per second; x memcpy:"
        " median of per-repetition ratios to memcpy's (heap reused, no allocation)"
        + ("" if len(modes) == 2 else "; fresh pages not measured: this libc has no mallopt")
    )


class Member:
    """One member's stream, ``size`` bytes of ``base`` from ``at``; zeros past its end (the group's padding)."""

    def __init__(self, base: memoryview, at: int, size: int):
        self.view, self.size = base[at : at + size], size

    def read(self, start: int, length: int) -> bytes | memoryview:
        if start + length <= self.size:
            return self.view[start : start + length]
        real = self.view[min(start, self.size) : self.size]
        return bytes(real) + bytes(length - len(real))


def encoded_shard_bytes(layout: GroupLayout, members: list[Member]) -> int:
    """Bytes of every parity shard of the group, built stripe by stripe in CHUNK_BYTES pieces as
    replicator/parity/encoder.py builds them (each position its ``held_by`` shards)."""
    code, length, total = codec(layout.data, layout.parity), layout.segment_bytes, 0
    for position in range(layout.size):
        for stripe_index, index in layout.held_by(position):
            for offset in range(0, length, CHUNK_BYTES):
                size = min(CHUNK_BYTES, length - offset)
                segments = [
                    members[p].read(layout.segment_of(p, stripe_index) * length + offset, size)
                    for p in layout.contributors(stripe_index)
                ]
                total += len(code.encode(segments)[index])
    if total != layout.size * layout.parity * length:
        raise RuntimeError(f"{total} parity bytes built, not {layout.size} x {layout.parity} x {length}")
    return total


def cluster_ram_rows() -> list[tuple[str, str, float, float, str, bool | None]]:
    """(redundancy, streams, measured, ideal, goal, met or None) rows."""
    rows: list[tuple[str, str, float, float, str, bool | None]] = [
        (f"replicas {r}", "any", 1.0 + r, 1.0 + r, "-", None) for r in REPLICAS
    ]
    longest = int(STREAM_BYTES * 1.1) + 8
    base = memoryview(np.random.default_rng(7).integers(0, 256, longest + 64 * 8, dtype=np.uint8).tobytes())
    for name, n, k in CODES:
        spreads = {
            f"equal, {n} x {STREAM_BYTES // MiB} MiB": [STREAM_BYTES] * n,
            f"unequal, {STREAM_BYTES // MiB} MiB +-10 %": [round(STREAM_BYTES * f) for f in np.linspace(0.9, 1.1, n)],
        }
        for label, sizes in spreads.items():
            members = [Member(base, 8 * p + p % 3, size) for p, size in enumerate(sizes)]
            layout = GroupLayout(tuple(range(n)), k, tuple(sizes))
            shards = encoded_shard_bytes(layout, members)
            measured = (sum(sizes) + shards) / sum(sizes)
            ideal = cluster_ram(n, k)
            if k == 1:
                goal = f"within 5 % of {n}/{n - 1}"
                met: bool | None = abs(measured / ideal - 1) <= GOAL_XOR_RAM
            else:
                goal, met = "-", None
            rows.append((name, label, measured, ideal, goal, met))
    return rows


def report_ram(rows: list[tuple[str, str, float, float, str, bool | None]]) -> None:
    print("== cluster RAM per unit of checkpoint: (stream bytes + parity shard bytes built) / stream bytes")
    print(f"  {'redundancy':<11} {'streams':<24} {'measured':>8} {'ideal':>7} {'over':>7}   {'goal':<20} verdict")
    for name, label, measured, ideal, goal, met in rows:
        over = f"{(measured / ideal - 1) * 100:+.2f}%"
        verdict = "-" if met is None else "met" if met else "MISSED"
        print(f"  {name:<11} {label:<24} {measured:>8.4f} {ideal:>7.4f} {over:>7}   {goal:<20} {verdict}")
    print("  ideal: 1 + replicas, or 1 + K/(N-K) (SCR's N/(N-1) for XOR); unequal streams pad to the longest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    started = time.monotonic()
    throughput(args.repetitions)
    report_ram(cluster_ram_rows())
    print(
        f"numpy {np.__version__}, pyeclib {version('pyeclib')}; {os.cpu_count()} CPUs, load average"
        f" {os.getloadavg()[0]:.1f} at the end; {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
