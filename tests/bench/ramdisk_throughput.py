"""Ramdisk throughput: a published checkpoint volume against a raw tmpfs, in the same run.

Measures sequential write (a 1 GiB file in 8 MiB blocks; open, fsync and close included) and
sequential read of that file, through the target path that a real ``mtc node`` agent bind-mounts
for a pod (``kubelet.publish``), and through a plain ``mount -t tmpfs`` of the same size.

The raw tmpfs is the physical limit: a published volume is itself a tmpfs, reached through a
bind mount, so both paths end in the same kernel copy between user memory and the page cache;
the driver can only lose against it. Ours/raw near 1.0 means the driver costs nothing on the
data path; the goal is >= 0.95.
Each repetition writes, reads and deletes the file on one path, then on the other, swapping
which goes first, so machine noise hits both alike; the ratio is the median of the per-repetition
ratios. Run as root: ``python -m tests.bench.ramdisk_throughput``.
"""

import mmap
import os
import statistics
import subprocess
import time

from csi_driver import kubelet
from examples.local_cluster import NodeAgentProcess, scratch_dir
from tests.helpers.ports import listen_address

GiB = 1 << 30
MiB = 1 << 20
VOLUME_SIZE = 2560 * MiB
FILE_SIZE = GiB
BLOCK = 8 * MiB
REPETITIONS = 15
GOAL = 0.95


def write_file(path: str, block: memoryview) -> float:
    """Writes FILE_SIZE bytes of ``block`` repeated to ``path``; returns seconds incl. fsync and close."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(FILE_SIZE // len(block)):
            written = 0
            while written < len(block):
                written += os.write(fd, block[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def read_file(path: str, block: memoryview) -> float:
    """Reads ``path`` to its end into ``block``; returns seconds incl. open and close."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while n := os.readv(fd, [block]):
            total += n
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    if total != FILE_SIZE:
        raise RuntimeError(f"read {total} bytes of {path}, expected {FILE_SIZE}")
    return elapsed


Sample = dict[tuple[str, str], float]  # (path name, operation) -> GiB/s


def repetition(dirs: dict[str, str], block: memoryview) -> Sample:
    """Per path, in ``dirs`` order: writes a file, reads it back, deletes it."""
    sample: Sample = {}
    for name, directory in dirs.items():
        path = os.path.join(directory, "bench.bin")
        sample[name, "write"] = FILE_SIZE / GiB / write_file(path, block)
        sample[name, "read"] = FILE_SIZE / GiB / read_file(path, block)
        os.unlink(path)
    return sample


def measure(dirs: dict[str, str]) -> list[Sample]:
    """REPETITIONS samples after one untimed warm-up, swapping which path goes first each time."""
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, reused for every write and read
    buffer.write(os.urandom(BLOCK))
    block = memoryview(buffer)
    try:
        repetition(dirs, block)
        orders = [list(dirs), list(dirs)[::-1]]
        return [repetition({name: dirs[name] for name in orders[rep % 2]}, block) for rep in range(REPETITIONS)]
    finally:
        block.release()
        buffer.close()


def report(samples: list[Sample]) -> None:
    print(f"{'operation':<10}{'ours GiB/s':>12}{'raw GiB/s':>12}{'ours/raw':>10}  goal")
    for op in ("write", "read"):
        ours = statistics.median(s["ours", op] for s in samples)
        raw = statistics.median(s["raw", op] for s in samples)
        ratio = statistics.median(s["ours", op] / s["raw", op] for s in samples)
        verdict = "PASS" if ratio >= GOAL else "BELOW"
        print(f"{op:<10}{ours:>12.2f}{raw:>12.2f}{ratio:>10.3f}  >= {GOAL} {verdict}")
    print(
        f"medians of {REPETITIONS} repetitions; ours/raw is the median of per-repetition ratios. "
        f"{FILE_SIZE // MiB} MiB file, {BLOCK // MiB} MiB blocks, {VOLUME_SIZE // MiB} MiB volumes."
    )


def main() -> None:
    with scratch_dir("mtc-bench-") as (workdir, cleanup):
        agent = NodeAgentProcess("bench", os.path.join(workdir, "agent"), listen_address(), "tmpfs")
        cleanup.callback(agent.stop)
        agent.start()
        target = os.path.join(workdir, "pods", "bench-pod", "volumes", "ramdisk")
        volume_id = kubelet.publish(
            agent.endpoint, target, "bench-pod", attributes={"job": "bench", "size": str(VOLUME_SIZE)}
        )
        cleanup.callback(kubelet.unpublish, agent.endpoint, target, volume_id)

        raw = os.path.join(workdir, "raw")
        os.mkdir(raw)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_SIZE}", "mtc-bench-raw", raw], check=True)

        report(measure({"ours": target, "raw": raw}))


if __name__ == "__main__":
    main()
