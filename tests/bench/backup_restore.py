"""Backup restore: ``BackupStore.download_rank`` against one stream per object, in the same run, for
each object store the backup tier speaks (``gs://`` and ``s3://``), with the client's CPU cost.

Starts fake-gcs-server (in-memory backend) and MinIO (single drive on /dev/shm) on loopback, uploads
one rank shard (1 GiB, 8 files of 128 MiB; ``--mib`` for a smaller one) to each with
``BackupStore.upload_rank`` and commits it, then restores it repeatedly, into tmpfs:

- ours: ``download_rank(workers=8)``, 32 MiB ranged reads on 8 threads, then ``verify_step``;
- ours with ``workers=1``: the same read path without parallelism, to show what each part brings;
- the baseline, one stream per object, one object after another: google-cloud-storage's
  ``blob.download_to_filename`` (it checks each object's CRC32C as it streams) and boto3's
  ``download_file`` with one GET per object, without threads (no checksum: MinIO's objects carry
  the whole-file CRC32C, which a GET of a multipart object does not return);
- ``s3://`` only, the other parallel clients: s3transfer's ``TransferManager`` with boto3's default
  ``TransferConfig`` (what ``download_file`` uses: 8 MiB ranged GETs on 10 threads), all objects
  submitted at once as s5cmd does; and the AWS CRT transfer client (``s3transfer.crt``, awscrt's
  native S3 client: 8 MiB ranged GETs on its own event-loop threads). boto3's own route to CRT
  (``TransferConfig(preferred_transfer_client="crt")``) always speaks TLS, so it cannot reach a
  plain-HTTP endpoint; the bench builds the CRT client directly and prints the class each path ran.

Neither baseline nor alternative verifies what it wrote (ours does, inside its timing). After each
timed restore every path's files are compared with the source by CRC32C, untimed, so no path wins by
skipping work; the client CPU that comparison costs is printed once, as what an alternative would
add to match ours.

The physical limit is the machine's CPUs: the server's copy out of memory (MinIO's also checks its
bitrot hashes), the loopback copy, the client's copy and the tmpfs pages all run on them, with no
per-stream network limit. Parallel ranged reads are meant for cloud storage, where one stream is
limited by the network (not measured here). Each restore's CPU seconds per GiB are printed apart for
the client (this process, ``getrusage(RUSAGE_SELF)``: all its threads, CRT's native ones too) and
the server (its process): when the two together reach the wall time times the CPUs, the CPUs are the
limit and no parallelism can help. Each repetition runs every path, rotating which goes first;
figures are medians over repetitions, and single/ours is the median of the per-repetition ratios;
the goal is >= 2. The servers' resident memory is reported: fake-gcs-server holds the shard (and
upload buffers) in RAM.
Run: ``python -m tests.bench.backup_restore [--mib 256] [--store s3]``.
"""

import argparse
import contextlib
import dataclasses
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import botocore.session
import google_crc32c
import psutil
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from s3transfer.crt import (
    BotocoreCRTCredentialsWrapper,
    BotocoreCRTRequestSerializer,
    CRTTransferManager,
    create_s3_crt_client,
)

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.store import BackupStore
from replicator.backup_tier.transfers import RankUpload
from replicator.local_tier.step_manifest import StepManifest, build_manifest
from replicator.wire.messages import JobRef
from tests.helpers.servers import FakeGcsServer, MinioServer, ServerProcess
from tests.helpers.tools import find_tool

MiB = 1 << 20
GiB = 1 << 30
FILES = 8
DEFAULT_MIB = 1024
REPETITIONS = 5
WORKERS = 8
GOAL = 2.0
BUCKET = "mtc-bench"
JOB = JobRef("bench", "job")
STEP = 100
REGION = "us-east-1"

Restore = Callable[[str], None]  # restores the shard's objects below a new directory
Objects = dict[str, str]  # relpath -> object name


@dataclasses.dataclass(frozen=True)
class Baseline:
    """A restore path other than ours: ``restore(objects, dest)``; ``label`` names it in the table;
    ``verifies``: it checks each object's CRC32C as it streams, as ours checks its files."""

    label: str
    restore: Callable[[Objects, str], None]
    verifies: bool = False


@dataclasses.dataclass(frozen=True)
class Backend:
    server: ServerProcess
    store: BackupStore
    baselines: dict[str, Baseline]  # "single" (the goal's baseline) first


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def client_cpu() -> float:
    """CPU seconds of this process so far, every thread (also awscrt's native ones)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def make_shard(directory: str, file_size: int) -> None:
    """FILES files of ``file_size`` random bytes under ``directory/state/d``."""
    os.makedirs(os.path.join(directory, "state", "d"))
    for i in range(FILES):
        with open(os.path.join(directory, "state", "d", f"shard-{i}"), "wb") as f:
            for start in range(0, file_size, 16 * MiB):
                f.write(os.urandom(min(16 * MiB, file_size - start)))


def check_restored(dest: str, manifest: StepManifest, path: str) -> None:
    """Asserts every file below ``dest`` has the source's size and CRC32C (``path`` names the restore path)."""
    for rel, (size, crc) in manifest.files.items():
        checksum, got = google_crc32c.Checksum(), 0
        with open(os.path.join(dest, rel), "rb", buffering=0) as f:
            for chunk in iter(lambda: f.read(4 * MiB), b""):
                checksum.update(chunk)
                got += len(chunk)
        if (got, checksum.hexdigest().decode()) != (size, crc):
            raise SystemExit(
                f"{path}: {rel} restored as {got} bytes with CRC32C {checksum.hexdigest().decode()}, "
                f"the source has {size} bytes with {crc}"
            )


def paths_in(objects: Objects, dest: str) -> dict[str, str]:
    """object name -> its local path below ``dest``, directories created."""
    paths = {}
    for rel, name in objects.items():
        paths[name] = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(paths[name]), exist_ok=True)
    return paths


def single_streams(download: Callable[[str, str], None]) -> Callable[[Objects, str], None]:
    """A restore of one ``download(object name, path)`` per object, one after another."""

    def restore(objects: Objects, dest: str) -> None:
        for name, path in paths_in(objects, dest).items():
            download(name, path)

    return restore


def all_at_once(manager) -> Callable[[Objects, str], None]:
    """A restore submitting every object to an s3transfer ``manager`` at once (as s5cmd does), then waiting."""

    def restore(objects: Objects, dest: str) -> None:
        for future in [manager.download(BUCKET, name, path) for name, path in paths_in(objects, dest).items()]:
            future.result()

    return restore


def gcs(workdir: str, file_size: int, cleanup: contextlib.ExitStack) -> Backend:
    server = FakeGcsServer(find_tool("fake-gcs-server")).start()
    cleanup.callback(server.stop)
    bucket = server.client().create_bucket(BUCKET)
    single = single_streams(lambda name, path: bucket.blob(name).download_to_filename(path))
    return Backend(
        server,
        open_backup_store(f"gs://{BUCKET}", emulator_host=server.url),
        {"single": Baseline("single stream: download_to_filename", single, verifies=True)},
    )


def s3(workdir: str, file_size: int, cleanup: contextlib.ExitStack) -> Backend:
    server = MinioServer(find_tool("minio"), os.path.join(workdir, "minio")).start()
    cleanup.callback(server.stop)
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    os.environ.update(server.client_env())  # boto3's standard configuration, as an agent gets it
    one_stream = TransferConfig(multipart_threshold=2 * file_size, use_threads=False)
    threaded = create_transfer_manager(client, TransferConfig())  # what download_file builds by default
    cleanup.callback(threaded.shutdown)
    session = botocore.session.get_session()
    crt = CRTTransferManager(
        create_s3_crt_client(
            REGION,
            BotocoreCRTCredentialsWrapper(session.get_credentials()).to_crt_credentials_provider(),
            use_ssl=server.url.startswith("https:"),
        ),
        BotocoreCRTRequestSerializer(session, {"region_name": REGION, "endpoint_url": server.url}),
    )
    cleanup.callback(crt.shutdown)
    return Backend(
        server,
        open_backup_store(f"s3://{BUCKET}"),
        {
            "single": Baseline(
                "single stream: download_file",
                single_streams(lambda name, path: client.download_file(BUCKET, name, path, Config=one_stream)),
            ),
            "threaded": Baseline(f"{type(threaded).__name__} (default config)", all_at_once(threaded)),
            "crt": Baseline(f"{type(crt).__name__} (awscrt)", all_at_once(crt)),
        },
    )


def bench(backend: str, start, mib: int) -> None:
    file_size = mib * MiB // FILES
    with contextlib.ExitStack() as cleanup:
        workdir = tempfile.mkdtemp(prefix="mtc-bench-backup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        setup = start(workdir, file_size, cleanup)
        store, server, server_process = setup.store, setup.server, psutil.Process(setup.server.pid)

        source = os.path.join(workdir, "source")
        make_shard(source, file_size)
        manifest = build_manifest(source, STEP, 0)
        upload_seconds = timed(lambda: store.upload_rank(RankUpload(JOB, STEP, 0, source, manifest)))
        assert store.commit_if_complete(JOB, STEP, nodes=1)
        prefix = f"{JOB}/steps/{STEP}/"
        objects = {rel: prefix + f.object for rel, f in store.rank_manifest(JOB, STEP, 0).files.items()}
        gib = manifest.total_bytes / GiB

        runs: dict[str, Restore] = {
            "ours": lambda dest: store.download_rank(JOB, STEP, 0, dest, workers=WORKERS),
            "ours-1": lambda dest: store.download_rank(JOB, STEP, 0, dest, workers=1),
        }
        runs |= {name: (lambda dest, b=b: b.restore(objects, dest)) for name, b in setup.baselines.items()}
        labels = {"ours": f"ours: download_rank(workers={WORKERS})", "ours-1": "ours: download_rank(workers=1)"}
        labels |= {name: b.label for name, b in setup.baselines.items()}
        verifies = {"ours", "ours-1"} | {name for name, b in setup.baselines.items() if b.verifies}
        samples: list[
            dict[str, tuple[float, float, float]]
        ] = []  # per repetition: name -> (wall s, client CPU s, server CPU s)
        check_cpu: list[float] = []
        peak_rss = server_process.memory_info().rss
        for rep in range(REPETITIONS + 1):  # the first is an untimed warm-up
            order = list(runs)[rep % len(runs) :] + list(runs)[: rep % len(runs)]
            sample = {}
            for name in order:
                dest = os.path.join(workdir, f"restore-{name}")
                client_before, server_before = client_cpu(), server_cpu(server_process)
                wall = timed(lambda: runs[name](dest))
                sample[name] = (wall, client_cpu() - client_before, server_cpu(server_process) - server_before)
                peak_rss = max(peak_rss, server_process.memory_info().rss)
                check_before = client_cpu()
                check_restored(dest, manifest, labels[name])
                check_cpu.append(client_cpu() - check_before)
                shutil.rmtree(dest)
            if rep:
                samples.append(sample)

        def median(name: str, i: int) -> float:
            return statistics.median(s[name][i] for s in samples)

        check = statistics.median(check_cpu) / gib
        print(
            f"{backend + ': restore of one rank':<44}{'wall s':>8}{'MiB/s':>7}{'single/x':>9}"
            f"{'CPU-s/GiB: client':>19}{'verified':>10}{'server':>8}"
        )
        for name, label in labels.items():
            ratio = statistics.median(s["single"][0] / s[name][0] for s in samples)
            client = median(name, 1) / gib
            print(
                f"{label:<44}{median(name, 0):>8.3f}{gib * 1024 / median(name, 0):>7.0f}{ratio:>9.2f}"
                f"{client:>19.2f}{client + (0 if name in verifies else check):>10.2f}{median(name, 2) / gib:>8.2f}"
            )
        ratio = statistics.median(s["single"][0] / s["ours"][0] for s in samples)
        verdict = "PASS" if ratio >= GOAL else "BELOW"
        print(f"{backend}: single/ours = {ratio:.2f} (median of per-repetition ratios), goal >= {GOAL}: {verdict}")
        print(
            f"{FILES} x {file_size / MiB:.0f} MiB = {gib * 1024:.0f} MiB, {REPETITIONS} repetitions after a warm-up; "
            f"every path's files matched the source's CRC32C afterwards; "
            f"'verified' adds that check's client cost ({check:.2f} CPU-s/GiB) to a path that does not verify as it reads; "
            f"upload_rank took {upload_seconds:.1f} s; "
            f"{server.name} peak RSS {peak_rss / MiB:.0f} MiB; {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.1f}.\n"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mib", type=int, default=DEFAULT_MIB, help=f"shard size in MiB, a multiple of {FILES} (default %(default)s)"
    )
    parser.add_argument(
        "--store", choices=("gs", "s3"), action="append", help="only this store (repeatable; default both)"
    )
    args = parser.parse_args()
    if args.mib < FILES or args.mib % FILES:
        parser.error(f"--mib must be a positive multiple of {FILES}, not {args.mib}")
    for tool in ("fake-gcs-server", "minio"):
        if find_tool(tool) is None:
            raise SystemExit(f"{tool} is neither on PATH nor in .tools/bin; run `make tools`")
    for store in args.store or ("gs", "s3"):
        bench(f"{store}://", {"gs": gcs, "s3": s3}[store], args.mib)


if __name__ == "__main__":
    main()
