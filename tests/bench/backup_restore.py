"""Backup restore: ``BackupStore.download_rank`` against one stream per object, in the same run, for
each object store the backup tier speaks (``gs://`` and ``s3://``).

Starts fake-gcs-server (in-memory backend) and MinIO (single drive on /dev/shm) on loopback, uploads
one 1 GiB rank shard (8 files of 128 MiB) to each with ``BackupStore.upload_rank`` and commits it,
then restores it repeatedly, into tmpfs:

- ours: ``download_rank(workers=8)``, 32 MiB ranged reads on 8 threads, then ``verify_step``;
- ours with ``workers=1``: the same read path without parallelism, to show what each part brings;
- the baseline, one stream per object, one object after another: google-cloud-storage's
  ``blob.download_to_filename`` (it checks each object's CRC32C as it streams) and boto3's
  ``download_file`` with one GET per object, without threads (no checksum: MinIO's objects carry
  the whole-file CRC32C, which a GET of a multipart object does not return).

The physical limit is the machine's CPUs: the server's copy out of memory (MinIO's also checks its
bitrot hashes), the loopback copy, the client's copy and the tmpfs pages all run on them, with no
per-stream network limit. Where the CPUs are few, one stream that reads 1 MiB at a time already uses
them, so much of the gain over the baseline comes from the read path (``workers=1``) rather than from
parallelism; parallel ranged reads are meant for cloud storage, where one stream is limited by the
network (not measured here). The CPU seconds each restore costs, client and server together, are
printed beside the wall time: when they reach the wall time times the CPUs, the CPUs are the limit
and no parallelism can help. Each repetition runs all three, rotating which goes first; single/ours
is the median of the per-repetition ratios; the goal is >= 2. The servers' resident memory is
reported: fake-gcs-server holds the shard (and upload buffers) in RAM.
Run: ``python -m tests.bench.backup_restore``.
"""

import contextlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import psutil
from boto3.s3.transfer import TransferConfig

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from replicator.backup_tier.backends import open_backup_store  # noqa: E402
from replicator.backup_tier.store import BackupStore  # noqa: E402
from replicator.local_tier.step_manifest import build_manifest  # noqa: E402
from tests.helpers.servers import FakeGcsServer, MinioServer, ServerProcess  # noqa: E402
from tests.helpers.tools import find_tool  # noqa: E402

MiB = 1 << 20
FILES = 8
FILE_SIZE = 128 * MiB
REPETITIONS = 5
WORKERS = 8
GOAL = 2.0
BUCKET = "mtc-bench"
JOB = "bench/job"
STEP = 100


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def make_shard(directory: str) -> None:
    """FILES files of FILE_SIZE random bytes under ``directory/state/d``."""
    os.makedirs(os.path.join(directory, "state", "d"))
    for i in range(FILES):
        with open(os.path.join(directory, "state", "d", f"shard-{i}"), "wb") as f:
            for _ in range(FILE_SIZE // (16 * MiB)):
                f.write(os.urandom(16 * MiB))


def single_streams(download: Callable[[str, str], None], objects: dict[str, str], dest: str) -> None:
    """``download(object name, path)`` for each object, one after another; ``objects`` is relpath -> name."""
    for rel, name in objects.items():
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        download(name, path)


def gcs(workdir: str, cleanup: contextlib.ExitStack) -> tuple[ServerProcess, BackupStore, Callable[[str, str], None], str]:
    server = FakeGcsServer(find_tool("fake-gcs-server")).start()
    cleanup.callback(server.stop)
    bucket = server.client().create_bucket(BUCKET)
    return (server, open_backup_store(f"gs://{BUCKET}", emulator_host=server.url),
            lambda name, path: bucket.blob(name).download_to_filename(path), "download_to_filename")  # fmt: skip


def s3(workdir: str, cleanup: contextlib.ExitStack) -> tuple[ServerProcess, BackupStore, Callable[[str, str], None], str]:
    server = MinioServer(find_tool("minio"), os.path.join(workdir, "minio")).start()
    cleanup.callback(server.stop)
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    os.environ.update(server.client_env())  # boto3's standard configuration, as an agent gets it
    one_stream = TransferConfig(multipart_threshold=2 * FILE_SIZE, use_threads=False)
    return (server, open_backup_store(f"s3://{BUCKET}"),
            lambda name, path: client.download_file(BUCKET, name, path, Config=one_stream), "download_file")  # fmt: skip


def bench(backend: str, start) -> None:
    with contextlib.ExitStack() as cleanup:
        workdir = tempfile.mkdtemp(prefix="mtc-bench-backup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        server, store, download, baseline = start(workdir, cleanup)
        server_process = psutil.Process(server.pid)

        source = os.path.join(workdir, "source")
        make_shard(source)
        manifest = build_manifest(source, STEP, 0)
        upload_seconds = timed(lambda: store.upload_rank(JOB, STEP, 0, source, manifest))
        assert store.commit_if_complete(JOB, STEP, nodes=1)
        prefix = f"{JOB}/steps/{STEP}/"
        objects = {rel: prefix + f.object for rel, f in store.rank_manifest(JOB, STEP, 0).files.items()}
        total_mib = manifest.total_bytes / MiB

        runs = {
            "ours": lambda dest: store.download_rank(JOB, STEP, 0, dest, workers=WORKERS),
            "ours-1": lambda dest: store.download_rank(JOB, STEP, 0, dest, workers=1),
            "single": lambda dest: single_streams(download, objects, dest),
        }
        samples: list[dict[str, float]] = []
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        both = [server_process, psutil.Process()]
        peak_rss = server_process.memory_info().rss
        for rep in range(REPETITIONS + 1):  # the first is an untimed warm-up
            order = list(runs)[rep % 3:] + list(runs)[:rep % 3]
            sample = {}
            for name in order:
                dest = os.path.join(workdir, f"restore-{name}")
                cpu_before = cpu_seconds(both)
                sample[name] = timed(lambda: runs[name](dest))
                cpu[name].append(cpu_seconds(both) - cpu_before)
                peak_rss = max(peak_rss, server_process.memory_info().rss)
                shutil.rmtree(dest)
            if rep:
                samples.append(sample)

        seconds = {name: statistics.median(s[name] for s in samples) for name in runs}
        ratio = statistics.median(s["single"] / s["ours"] for s in samples)
        labels = {"ours": f"ours: download_rank(workers={WORKERS})", "ours-1": "ours: download_rank(workers=1)",
                  "single": f"single stream: {baseline}"}
        print(f"{backend + ': restore of one rank':<42}{'median s':>10}{'MiB/s':>9}{'CPU s':>8}")
        for name, label in labels.items():
            print(f"{label:<42}{seconds[name]:>10.3f}{total_mib / seconds[name]:>9.0f}{statistics.median(cpu[name][1:]):>8.2f}")
        verdict = "PASS" if ratio >= GOAL else "BELOW"
        print(f"{backend}: single/ours = {ratio:.2f} (median of per-repetition ratios), goal >= {GOAL}: {verdict}")
        print(f"{FILES} x {FILE_SIZE // MiB} MiB = {total_mib:.0f} MiB, {REPETITIONS} repetitions after a warm-up; "
              f"upload_rank took {upload_seconds:.1f} s; {server.name} peak RSS {peak_rss / MiB:.0f} MiB; "
              f"{os.cpu_count()} CPUs.\n")


def main() -> None:
    for tool in ("fake-gcs-server", "minio"):
        if find_tool(tool) is None:
            raise SystemExit(f"{tool} is neither on PATH nor in .tools/bin; run `make tools`")
    bench("gs://", gcs)
    bench("s3://", s3)


if __name__ == "__main__":
    main()
