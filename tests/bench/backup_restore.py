"""Backup restore: ``BackupStore.download_rank`` against one stream per object, in the same run.

Starts a fake-gcs-server (in-memory backend) on loopback, uploads one 1 GiB rank shard (8 files of
128 MiB) with ``BackupStore.upload_rank`` and commits it, then restores it repeatedly, into tmpfs:

- ours: ``download_rank(workers=8)``, 32 MiB ranged reads on 8 threads, then ``verify_step``;
- ours with ``workers=1``: the same read path without parallelism, to show what each part brings;
- the baseline: google-cloud-storage's ``blob.download_to_filename`` for each object, one after another
  (it checks each object's CRC32C as it streams, so both sides verify what they write).

The physical limit is the machine's CPUs: the server's copy out of memory, the loopback copy, the
client's copy and the tmpfs pages all run on them, with no per-stream network limit. Where the CPUs
are few, one stream that reads 1 MiB at a time already uses them, so most of the gain over the
baseline comes from the read path (``workers=1``) rather than from parallelism; parallel ranged reads
are meant for GCS, where one stream is limited by the network (not measured here). Each repetition runs all
three, rotating which goes first; single/ours is the median of the per-repetition ratios; the goal is >= 2.
fake-gcs-server's resident memory is reported: it holds the shard (and upload buffers) in RAM.
Run: ``python -m tests.bench.backup_restore``.
"""

import contextlib
import os
import shutil
import statistics
import tempfile
import time
import warnings

import psutil

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from replicator.backup_store import BackupStore, open_backup_store  # noqa: E402
from replicator.step_manifest import build_manifest  # noqa: E402
from examples.local_cluster import FakeGcsServer, find_fake_gcs_server  # noqa: E402

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


def make_shard(directory: str) -> None:
    """FILES files of FILE_SIZE random bytes under ``directory/state/d``."""
    os.makedirs(os.path.join(directory, "state", "d"))
    for i in range(FILES):
        with open(os.path.join(directory, "state", "d", f"shard-{i}"), "wb") as f:
            for _ in range(FILE_SIZE // (16 * MiB)):
                f.write(os.urandom(16 * MiB))


def restore_ours(store: BackupStore, dest: str, workers: int) -> None:
    store.download_rank(JOB, STEP, 0, dest, workers=workers)


def restore_single_stream(bucket, objects: dict[str, str], dest: str) -> None:
    """Each object with ``download_to_filename``, one after another; ``objects`` is relpath -> object name."""
    for rel, name in objects.items():
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        bucket.blob(name).download_to_filename(path)


def main() -> None:
    binary = find_fake_gcs_server()
    if binary is None:
        raise SystemExit("fake-gcs-server is neither on PATH nor in .tools/bin; run `make tools`")
    with contextlib.ExitStack() as cleanup:
        workdir = tempfile.mkdtemp(prefix="mtc-bench-backup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        server = FakeGcsServer(binary).start()
        cleanup.callback(server.stop)
        server_process = psutil.Process(server.pid)
        bucket = server.client().create_bucket(BUCKET)
        store = open_backup_store(f"gs://{BUCKET}", emulator_host=server.url)

        source = os.path.join(workdir, "source")
        make_shard(source)
        manifest = build_manifest(source, STEP, 0)
        upload_seconds = timed(lambda: store.upload_rank(JOB, STEP, 0, source, manifest))
        assert store.commit_if_complete(JOB, STEP, nodes=1)
        prefix = f"{JOB}/steps/{STEP}/"
        objects = {rel: prefix + f.object for rel, f in store.rank_manifest(JOB, STEP, 0).files.items()}
        total_mib = manifest.total_bytes / MiB

        runs = {
            "ours": lambda dest: restore_ours(store, dest, WORKERS),
            "ours-1": lambda dest: restore_ours(store, dest, 1),
            "single": lambda dest: restore_single_stream(bucket, objects, dest),
        }
        samples: list[dict[str, float]] = []
        peak_rss = server_process.memory_info().rss
        for rep in range(REPETITIONS + 1):  # the first is an untimed warm-up
            order = list(runs)[rep % 3:] + list(runs)[:rep % 3]
            sample = {}
            for name in order:
                dest = os.path.join(workdir, f"restore-{name}")
                sample[name] = timed(lambda: runs[name](dest))
                peak_rss = max(peak_rss, server_process.memory_info().rss)
                shutil.rmtree(dest)
            if rep:
                samples.append(sample)

        seconds = {name: statistics.median(s[name] for s in samples) for name in runs}
        ratio = statistics.median(s["single"] / s["ours"] for s in samples)
        labels = {"ours": f"ours: download_rank(workers={WORKERS})", "ours-1": "ours: download_rank(workers=1)",
                  "single": "single stream: download_to_filename"}
        print(f"{'restore of one rank':<40}{'median s':>10}{'MiB/s':>9}")
        for name, label in labels.items():
            print(f"{label:<40}{seconds[name]:>10.3f}{total_mib / seconds[name]:>9.0f}")
        verdict = "PASS" if ratio >= GOAL else "BELOW"
        print(f"single/ours = {ratio:.2f} (median of per-repetition ratios), goal >= {GOAL}: {verdict}")
        print(f"{FILES} x {FILE_SIZE // MiB} MiB = {total_mib:.0f} MiB, {REPETITIONS} repetitions after a warm-up; "
              f"upload_rank took {upload_seconds:.1f} s; fake-gcs-server peak RSS {peak_rss / MiB:.0f} MiB; "
              f"{os.cpu_count()} CPUs.")


if __name__ == "__main__":
    main()
