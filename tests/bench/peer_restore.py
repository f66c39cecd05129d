"""Peer restore throughput: ``fetch_step`` from a peer service against raw loopback TCP, in the same run.

A 1 GiB shard (8 files of 128 MiB) sits in a tmpfs "ramdisk" as a committed step. A separate
process serves it: the peer service (aiohttp, sendfile) or a plain socket sender (``socket.sendfile``
of every file, back to back, on one connection). This process receives it into another tmpfs:
through ``fetch_step`` (ranged GETs written with ``pwrite``, CRC-32C of every received byte checked
against the manifest), or with ``recv_into`` + ``write``. Sender and receiver are separate processes, so they do not share
a GIL.

Raw loopback TCP into tmpfs is the physical limit: both paths pay the same kernel copies (page cache
to socket, socket to user memory, user memory to tmpfs); ours adds HTTP, Python per chunk, and
the checksum, which a restore cannot skip. The goal is ours/raw >= 0.7.
Each repetition restores once each way, swapping which goes first; throughput is the 1 GiB divided
by the wall time from the first request to the last byte written (and, for ours, verified).
Run as root: ``python -m tests.bench.peer_restore``.
"""

import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

from examples.local_cluster import scratch_dir
from prefetch.peer_fetch import fetch_step
from replicator.job_meta import JobMeta
from replicator.peer_service import add_peer_routes
from replicator.step_manifest import StepManifest, build_manifest

GiB = 1 << 30
MiB = 1 << 20
FILES = 8
FILE_SIZE = 128 * MiB
TMPFS_SIZE = FILES * FILE_SIZE + 256 * MiB
RECV_BUFFER = 4 * MiB
REPETITIONS = 11
GOAL = 0.7
TOKEN = "bench-token"
NAMESPACE, JOB, RANK, STEP = "default", "bench", 0, 100


def serve_peer(ramdisk: str) -> None:
    """The peer side: a node-agent-like app serving the job on ``ramdisk``; prints its port, runs until killed."""

    async def serve() -> None:
        app = web.Application()
        add_peer_routes(app, lambda namespace, job: ramdisk if (namespace, job) == (NAMESPACE, JOB) else None, TOKEN)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


def serve_raw(step_dir: str) -> None:
    """The raw side: per connection, ``socket.sendfile`` of every file of ``step_dir`` in sorted order;
    prints its port, runs until killed."""
    names = sorted(os.listdir(step_dir))
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        while True:
            connection, _ = server.accept()
            with connection:
                for name in names:
                    with open(os.path.join(step_dir, name), "rb") as f:
                        connection.sendfile(f)


def start_server(cleanup: contextlib.ExitStack, role: str, path: str) -> int:
    """Starts ``role`` (peer or raw) serving ``path`` in a subprocess; returns its port once it listens."""
    process = subprocess.Popen([sys.executable, "-m", "tests.bench.peer_restore", role, path], stdout=subprocess.PIPE, text=True)
    cleanup.callback(process.stdout.close)
    cleanup.callback(process.wait, 10)
    cleanup.callback(process.kill)
    line = process.stdout.readline()  # the port, or "" when it died first
    if not line:
        raise RuntimeError(f"the {role} server did not start (exit code {process.wait(10)})")
    return int(line)


def receive_raw(port: int, dest_dir: str, names: list[str], buffer: memoryview) -> float:
    """Receives every file from the raw sender into ``dest_dir``; returns seconds."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for name in names:
            fd = os.open(os.path.join(dest_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                remaining = FILE_SIZE
                while remaining:
                    n = connection.recv_into(buffer, min(len(buffer), remaining))
                    if not n:
                        raise RuntimeError(f"raw sender closed with {remaining} bytes of {name} unsent")
                    written = 0
                    while written < n:
                        written += os.write(fd, buffer[written:n])
                    remaining -= n
            finally:
                os.close(fd)
    return time.perf_counter() - start


async def receive_ours(session: aiohttp.ClientSession, port: int, dest_dir: str, manifest: StepManifest) -> float:
    """``fetch_step`` of the whole step into ``dest_dir``; returns seconds incl. the checksum check."""
    start = time.perf_counter()
    fetched = await fetch_step(session, f"http://127.0.0.1:{port}", TOKEN, NAMESPACE, JOB, RANK, STEP, dest_dir)
    elapsed = time.perf_counter() - start
    if fetched != manifest:
        raise RuntimeError("fetch_step returned another manifest")
    return elapsed


def make_shard(ramdisk: str) -> StepManifest:
    """Writes the step's FILES random files into the ramdisk's client dir and records its manifest."""
    meta = JobMeta(ramdisk)
    step_dir = os.path.join(meta.client_dir, str(STEP))
    os.makedirs(step_dir)
    for i in range(FILES):
        with open(os.path.join(step_dir, f"shard-{i}.bin"), "wb") as f:
            for _ in range(FILE_SIZE // (16 * MiB)):
                f.write(os.urandom(16 * MiB))
    manifest = build_manifest(step_dir, STEP, RANK)
    meta.save_manifest(manifest)
    return manifest


async def measure(peer_port: int, raw_port: int, dest_root: str, manifest: StepManifest) -> list[dict[str, float]]:
    """REPETITIONS samples (GiB/s per path) after one untimed warm-up of each, alternating which goes first."""
    names = sorted(os.path.basename(rel) for rel in manifest.files)
    buffer = memoryview(bytearray(RECV_BUFFER))
    dest = os.path.join(dest_root, "restore")
    gib = manifest.total_bytes / GiB

    async with aiohttp.ClientSession() as session:

        async def once(path: str) -> float:
            os.mkdir(dest)
            try:
                if path == "ours":
                    return gib / await receive_ours(session, peer_port, dest, manifest)
                return gib / await asyncio.to_thread(receive_raw, raw_port, dest, names, buffer)
            finally:
                shutil.rmtree(dest)

        await once("ours")
        await once("raw")
        samples = []
        for rep in range(REPETITIONS):
            order = ["ours", "raw"] if rep % 2 == 0 else ["raw", "ours"]
            samples.append({path: await once(path) for path in order})
        return samples


def report(samples: list[dict[str, float]]) -> None:
    ours = statistics.median(s["ours"] for s in samples)
    raw = statistics.median(s["raw"] for s in samples)
    ratio = statistics.median(s["ours"] / s["raw"] for s in samples)
    verdict = "PASS" if ratio >= GOAL else "BELOW"
    print(f"{'operation':<16}{'ours GiB/s':>12}{'raw GiB/s':>12}{'ours/raw':>10}  goal")
    print(f"{'peer restore':<16}{ours:>12.2f}{raw:>12.2f}{ratio:>10.3f}  >= {GOAL} {verdict}")
    print(f"medians of {REPETITIONS} repetitions; ours/raw is the median of per-repetition ratios. "
          f"{FILES} files of {FILE_SIZE // MiB} MiB, tmpfs to tmpfs over 127.0.0.1; ours includes the CRC-32C check.")


def main() -> None:
    with scratch_dir("mtc-bench-peer-") as (workdir, cleanup):
        mounts = {}
        for name in ("source", "dest"):
            mounts[name] = os.path.join(workdir, name)
            os.mkdir(mounts[name])
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", f"mtc-bench-{name}", mounts[name]], check=True)
        manifest = make_shard(mounts["source"])
        peer_port = start_server(cleanup, "peer", mounts["source"])
        raw_port = start_server(cleanup, "raw", os.path.join(JobMeta(mounts["source"]).client_dir, str(STEP)))
        report(asyncio.run(measure(peer_port, raw_port, mounts["dest"], manifest)))


if __name__ == "__main__":
    if len(sys.argv) == 3:  # a server process started by start_server
        {"peer": serve_peer, "raw": serve_raw}[sys.argv[1]](sys.argv[2])
    else:
        main()
