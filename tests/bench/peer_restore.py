"""Peer restore throughput: ``fetch_step`` from a peer service against raw loopback TCP and tmpfs, in the same run.

A shard of ``--gib`` GiB (default 1; files of 128 MiB) sits in a tmpfs "ramdisk" as a committed step.
Separate processes serve it: the peer service (aiohttp, ``sendfile``) and a plain socket sender
(``socket.sendfile`` of whole files, asked for by index, any number of connections). This process
receives it into another tmpfs:

- ours: ``fetch_step`` with K workers (K = CPUs): ranged GETs on K connections, each byte written
  with ``pwrite`` and its CRC-32C checked against the manifest;
- raw 1-stream: one connection, ``recv_into`` + ``write``, every file back to back;
- raw K-stream: K threads, one connection each, taking files from a shared queue.

Raw loopback TCP into tmpfs is the physical limit: both paths pay the same kernel copies (page cache
to socket, socket to user memory, user memory to tmpfs); ours adds HTTP, Python per chunk and the
checksum, which a restore cannot skip. Goals: ours/raw 1-stream >= 0.8, ours/raw K-stream >= 0.7.

With ``--cores`` it also measures how the receive path scales with cores: ours with 1 worker and
with K, against first-touch tmpfs writes (``write`` of a cached buffer into new files, the memory
bandwidth a restore into a ramdisk cannot beat) on 1 and on K threads. The ratio should hold as
cores are added, not fall.

Each repetition runs every path once, rotating which goes first; throughput is bytes over the wall
time from the first request to the last byte written (and, for ours, verified).
Run as root: ``python -m tests.bench.peer_restore [--gib N] [--cores]``.
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from aiohttp import web

from examples.local_cluster import scratch_dir
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import StepManifest, build_manifest
from replicator.peer_tier.client import fetch_step
from replicator.peer_tier.service import add_peer_routes
from replicator.wire.bearer import Tokens

GiB = 1 << 30
MiB = 1 << 20
FILE_SIZE = 128 * MiB
RECV_BUFFER = 4 * MiB
REPETITIONS = 7
GOAL_RAW_1, GOAL_RAW_K = 0.8, 0.7
TOKEN = "bench-token"
NAMESPACE, JOB, RANK, STEP = "default", "bench", 0, 100
CORES = os.cpu_count() or 1


def serve_peer(ramdisk: str) -> None:
    """The peer side: a node-agent-like app serving the job on ``ramdisk``; prints its port, runs until killed."""

    async def serve() -> None:
        app = web.Application()
        add_peer_routes(
            app, lambda namespace, job: ramdisk if (namespace, job) == (NAMESPACE, JOB) else None, Tokens.of(TOKEN)
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


def serve_raw(step_dir: str) -> None:
    """The raw side: each connection sends file indexes, one per line; each is answered with
    ``socket.sendfile`` of that file of ``step_dir`` (sorted names). Prints its port, runs until killed."""
    names = sorted(os.listdir(step_dir))

    def answer(connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as requests:
            for line in requests:
                with open(os.path.join(step_dir, names[int(line)]), "rb") as f:
                    connection.sendfile(f)

    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        while True:
            threading.Thread(target=answer, args=(server.accept()[0],), daemon=True).start()


def start_server(cleanup: contextlib.ExitStack, role: str, path: str) -> int:
    """Starts ``role`` (peer or raw) serving ``path`` in a subprocess; returns its port once it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.peer_restore", role, path], stdout=subprocess.PIPE, text=True
    )
    cleanup.callback(process.stdout.close)
    cleanup.callback(process.wait, 10)
    cleanup.callback(process.kill)
    line = process.stdout.readline()  # the port, or "" when it died first
    if not line:
        raise RuntimeError(f"the {role} server did not start (exit code {process.wait(10)})")
    return int(line)


def on_threads(threads: int, items: list, work: Callable[[Iterator], None]) -> None:
    """Runs ``work(shared iterator over items)`` on ``threads`` threads at once; raises the first error."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for item in items:
        pending.put(item)

    def take() -> Iterator:
        with contextlib.suppress(queue.Empty):
            while True:
                yield pending.get_nowait()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(work, take()) for _ in range(threads)]:
            future.result()


def receive_raw(port: int, dest_dir: str, names: list[str], streams: int) -> None:
    """Receives every file from the raw sender into ``dest_dir`` on ``streams`` connections."""

    def stream(pending: Iterator[int]) -> None:
        buffer = memoryview(bytearray(RECV_BUFFER))
        with socket.create_connection(("127.0.0.1", port)) as connection:
            for index in pending:
                connection.sendall(f"{index}\n".encode())
                fd = os.open(os.path.join(dest_dir, names[index]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    remaining = FILE_SIZE
                    while remaining:
                        n = connection.recv_into(buffer, min(len(buffer), remaining))
                        if not n:
                            raise RuntimeError(f"raw sender closed with {remaining} bytes of {names[index]} unsent")
                        written = 0
                        while written < n:
                            written += os.write(fd, buffer[written:n])
                        remaining -= n
                finally:
                    os.close(fd)

    on_threads(streams, list(range(len(names))), stream)


def first_touch(dest_dir: str, names: list[str], threads: int, block: bytes) -> None:
    """Writes FILE_SIZE bytes of ``block`` repeated into each new file of ``dest_dir``, on ``threads`` threads."""

    def writer(pending: Iterator[str]) -> None:
        for name in pending:
            fd = os.open(os.path.join(dest_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for _ in range(FILE_SIZE // len(block)):
                    os.write(fd, block)  # tmpfs writes a whole block or raises
            finally:
                os.close(fd)

    on_threads(threads, names, writer)


def make_shard(ramdisk: str, files: int) -> StepManifest:
    """Writes the step's ``files`` random files into the ramdisk's client dir and records its manifest."""
    meta = JobMeta(ramdisk)
    step_dir = os.path.join(meta.client_dir, str(STEP))
    os.makedirs(step_dir)
    for i in range(files):
        with open(os.path.join(step_dir, f"shard-{i:03d}.bin"), "wb") as f:
            for _ in range(FILE_SIZE // (16 * MiB)):
                f.write(os.urandom(16 * MiB))
    manifest = build_manifest(step_dir, STEP, RANK)
    meta.save_manifest(manifest)
    return manifest


def paths(peer_port: int, raw_port: int, manifest: StepManifest, cores: bool) -> dict[str, Callable[[str], None]]:
    """name -> receive the whole step into the given directory."""
    names = sorted(os.path.basename(rel) for rel in manifest.files)
    block = os.urandom(4 * MiB)

    def ours(workers: int) -> Callable[[str], None]:
        return lambda dest: asyncio.run(
            fetch_step(f"http://127.0.0.1:{peer_port}", TOKEN, NAMESPACE, JOB, manifest, dest, workers=workers)
        )

    found = {
        "ours": ours(CORES),
        "raw 1-stream": lambda dest: receive_raw(raw_port, dest, names, 1),
        f"raw {CORES}-stream": lambda dest: receive_raw(raw_port, dest, names, CORES),
    }
    if cores:
        found.update(
            {
                "ours 1 worker": ours(1),
                "tmpfs 1 thread": lambda dest: first_touch(dest, names, 1, block),
                f"tmpfs {CORES} threads": lambda dest: first_touch(dest, names, CORES, block),
            }
        )
    return found


def measure(
    receivers: dict[str, Callable[[str], None]], dest_root: str, gib: float, repetitions: int
) -> list[dict[str, float]]:
    """``repetitions`` samples (GiB/s per path) after one untimed warm-up of each, rotating which goes first."""
    return [{name: gib / s for name, s in sample.items()} for sample in timed(receivers, dest_root, repetitions)]


def timed(receivers: dict[str, Callable[[str], None]], dest_root: str, repetitions: int) -> list[dict[str, float]]:
    """``repetitions`` samples (seconds per path, each into an empty ``dest_root/restore``) after one untimed
    warm-up of each, rotating which goes first."""
    dest = os.path.join(dest_root, "restore")

    def once(name: str) -> float:
        os.mkdir(dest)
        try:
            start = time.perf_counter()
            receivers[name](dest)
            return time.perf_counter() - start
        finally:
            shutil.rmtree(dest)

    order = list(receivers)
    for name in order:
        once(name)
    samples = []
    for rep in range(repetitions):
        rotated = order[rep % len(order) :] + order[: rep % len(order)]
        samples.append({name: once(name) for name in rotated})
    return samples


def report(samples: list[dict[str, float]], gib: float, cores: bool) -> None:
    def median(name: str) -> float:
        return statistics.median(s[name] for s in samples)

    def ratio(a: str, b: str) -> float:
        return statistics.median(s[a] / s[b] for s in samples)

    def row(label: str, a: str, b: str, goal: float | None) -> None:
        r = ratio(a, b)
        verdict = f">= {goal} {'PASS' if r >= goal else 'BELOW'}" if goal else "report"
        print(f"{label:<30}{median(a):>10.2f}{median(b):>11.2f}{r:>9.3f}  {verdict}")

    print(f"{'operation':<30}{'ours GiB/s':>10}{'base GiB/s':>11}{'ratio':>9}  goal")
    row("peer restore vs raw 1-stream", "ours", "raw 1-stream", GOAL_RAW_1)
    row(f"peer restore vs raw {CORES}-stream", "ours", f"raw {CORES}-stream", GOAL_RAW_K)
    if cores:
        row("1 worker vs tmpfs 1 thread", "ours 1 worker", "tmpfs 1 thread", None)
        row(f"{CORES} workers vs tmpfs {CORES} threads", "ours", f"tmpfs {CORES} threads", None)
        print(
            f"scaling 1 -> {CORES} cores: ours x{ratio('ours', 'ours 1 worker'):.2f}, "
            f"first-touch tmpfs x{ratio(f'tmpfs {CORES} threads', 'tmpfs 1 thread'):.2f}"
        )
    print(
        f"medians of {len(samples)} repetitions; ratios are medians of per-repetition ratios. {gib:g} GiB in "
        f"{FILE_SIZE // MiB} MiB files, tmpfs to tmpfs over 127.0.0.1; ours = fetch_step with {CORES} workers "
        f"incl. the CRC-32C check; {CORES} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=int, default=1, help="shard size, GiB")
    parser.add_argument("--cores", action="store_true", help="also 1 worker and first-touch tmpfs on 1 and K threads")
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    args = parser.parse_args()
    files = args.gib * GiB // FILE_SIZE
    with scratch_dir("mtc-bench-peer-") as (workdir, cleanup):
        mounts = {}
        for name in ("source", "dest"):
            mounts[name] = os.path.join(workdir, name)
            os.mkdir(mounts[name])
            size = files * FILE_SIZE + 256 * MiB
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", f"mtc-bench-{name}", mounts[name]], check=True
            )
        manifest = make_shard(mounts["source"], files)
        peer_port = start_server(cleanup, "peer", mounts["source"])
        raw_port = start_server(cleanup, "raw", os.path.join(JobMeta(mounts["source"]).client_dir, str(STEP)))
        receivers = paths(peer_port, raw_port, manifest, args.cores)
        report(
            measure(receivers, mounts["dest"], manifest.total_bytes / GiB, args.repetitions),
            manifest.total_bytes / GiB,
            args.cores,
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("peer", "raw"):  # a server process started by start_server
        {"peer": serve_peer, "raw": serve_raw}[sys.argv[1]](sys.argv[2])
    else:
        main()
