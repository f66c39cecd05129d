"""Read-once restores and shared backup uploads of a data-parallel job, before (one uploader per
identical group, every node downloading: ``--no-restore-fan-out``, first) and after
(``--shared-backup-upload``, fan-out), in the same run.

A real data-parallel Orbax job (``examples/train.py``, DP slices of one node each, so every rank
holds the same data, with ``--ballast-mib`` MiB per rank replicated across slices) trains on real
agents and a real coordinator until a backup of a step whose ranks were found identical is
complete; then every node is lost (the coordinator survives; ``--holder-grace-seconds 5``, so the
lost nodes' copies are given up within seconds, not the default minute), fresh nodes join and the
job restores from fake-gcs-server, whose request log counts what it served. Printed per mode:

- store bytes read ÷ unique checkpoint bytes: the bytes of every shard object the store served
  for the restored step, over one rank's shard bytes (DP ranks hold the same data); goal 1.0 with
  fan-out;
- restore seconds: the slowest agent's ``mtc_restore_seconds`` (``replicator.yaml`` consumed to
  marker written, which waits for every rank);
- upload share: the largest bytes one rank uploaded for the restored step's backup ÷ the unique
  checkpoint bytes (objects are stored under the uploading rank's prefix): what the busiest
  node sends, so on per-node links the backup takes that share of one uploader's time (goal 1/DP);
- backup seconds: the backup's first object created to its ``COMMIT`` (the store's times). The
  nodes of one machine share one loopback link, so this shows the parallelism, not the per-link gain.

Medians over ``--repetitions`` runs per mode.

With ``--store-mbit`` the store's loopback traffic is shaped to that rate, as a bucket that is the
bottleneck would be. Run: ``python -m tests.bench.restore_fan_out [--dp 4] [--repetitions 1] [--ballast-mib 16] [--store-mbit R]``.
"""

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import statistics
import tempfile
import time
import warnings

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, unmount_all_below
from replicator.backup_tier.layout import RankManifest
from tests.helpers import network
from tests.helpers.jobs import UNTIL_KILLED, kill_past_newest_commit, kill_started_jobs, recreate, run_job, status_of
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address
from tests.helpers.servers import FakeGcsServer
from tests.helpers.tools import find_tool
from tests.helpers.trainer_oracle import restore_seconds

GOAL = 1.0
_RANK_OBJECT = re.compile(r"^rank-(\d+)/")


@dataclasses.dataclass(frozen=True)
class Run:
    """One backup and cluster-loss restore of the job.

    Attributes:
      read_ratio: store bytes served for the restored step's shards ÷ ``unique_bytes``.
      restore_seconds: the slowest agent's restore.
      unique_bytes: one rank's shard bytes (every rank holds the same data).
      upload_share: the largest bytes one rank uploaded for the backup ÷ ``unique_bytes``: what the
        busiest node's link carried, in checkpoints.
      backup_seconds: the backup's first object created to its COMMIT created (the store's times).
    """

    read_ratio: float
    restore_seconds: float
    unique_bytes: int
    upload_share: float
    backup_seconds: float


def backup_figures(bucket, prefix: str, unique: int) -> tuple[float, float]:
    """(largest bytes one rank uploaded ÷ ``unique``, seconds from the first object to COMMIT) of the step at ``prefix``."""
    blobs = list(bucket.list_blobs(prefix=prefix))
    per_rank: dict[str, int] = {}
    for blob in blobs:
        if found := _RANK_OBJECT.match(blob.name[len(prefix) :]):
            per_rank[found.group(1)] = per_rank.get(found.group(1), 0) + blob.size
    commit = next(b.time_created for b in blobs if b.name == prefix + "COMMIT")
    return max(per_rank.values()) / unique, (commit - min(b.time_created for b in blobs)).total_seconds()


def one_run(workdir: str, dp: int, after: bool, ballast_mib: int, store_mbit: float | None) -> Run:
    """Trains until a backup of a step whose ranks were found identical, loses every node and
    restores once; ``after``: shared uploads and fan-out, else one uploader and every node downloading."""
    with contextlib.ExitStack() as cleanup:
        server = FakeGcsServer(
            find_tool("fake-gcs-server"), request_log=os.path.join(workdir, "gcs-requests.log")
        ).start()
        cleanup.callback(server.stop)
        bucket = server.client().create_bucket("ckpt")
        cluster = LocalCluster(
            os.path.join(workdir, "cluster"),
            listen_address,
            backup="gs://ckpt/mtc",
            env={"STORAGE_EMULATOR_HOST": server.url},
        )
        modes = ["--shared-backup-upload"] if after else ["--no-restore-fan-out"]
        cluster.coordinator.extra_args += ["--holder-grace-seconds", "5", *modes]
        cleanup.callback(unmount_all_below, workdir)
        cleanup.callback(cluster.stop)
        cleanup.callback(kill_started_jobs)
        cluster.start(dp)
        job = run_job(
            "fan",
            list(cluster.agents),
            os.path.join(workdir, "job"),
            [
                *UNTIL_KILLED,
                "--dump-dir",
                os.path.join(workdir, "dump"),
                "--ballast-mib",
                str(ballast_mib),
                "--ballast-layout",
                "data-parallel",
            ],
            slices=dp,
        )

        def identical_at():
            status = status_of(cluster, job)
            return status["newest_complete_step"] if len(status["identical_peers"]) == dp * (dp - 1) else None

        job.wait(identical_at, 300, "the ranks found identical")
        known = identical_at()  # a backup ordered after this step's identity is known is deduplicated
        job.wait(
            lambda: max(status_of(cluster, job)["backups"] or [-1]) > known,
            300,
            "a backup ordered once identity was known",
        )
        kill_past_newest_commit(job)
        wait_until(lambda: status_of(cluster, job)["backup_pending"] is None, 60, "backups settled")
        step = max(status_of(cluster, job)["backups"])
        for agent in list(job.agents):
            cluster.lose_node(agent)
        fresh = [cluster.add_node(dp + i, block=f"b{i}") for i in range(dp)]
        prefix = f"mtc/default/{job.job}/steps/{step}/"
        shaped = (
            network.rate_limited([network.Endpoint("127.0.0.1", server.port)], store_mbit)
            if store_mbit
            else contextlib.nullcontext()
        )
        with shaped:
            recreate(job, os.path.join(workdir, "dump-2"), agents=fresh, steps=step + 2)
            wait_until(lambda: all(restore_seconds(a) > 0 for a in fresh), 280, "every rank restored")
        seconds = max(restore_seconds(a) for a in fresh)
        sizes = {blob.name: blob.size for blob in bucket.list_blobs(prefix=prefix)}
        read = sum(
            n * sizes[name]
            for name, n in server.object_reads("ckpt", prefix + "rank-").items()
            if "/" in name[len(prefix) :]
        )
        manifest = RankManifest.from_json(bucket.blob(f"{prefix}rank-0.manifest.json").download_as_text())
        unique = sum(f.size for f in manifest.files.values())
        job.wait_done(timeout=240)
        return Run(read / unique, seconds, unique, *backup_figures(bucket, prefix, unique))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=4, help="data parallelism: slices of one node each (default 4)")
    parser.add_argument("--repetitions", type=int, default=1, help="runs per mode (default 1)")
    parser.add_argument(
        "--ballast-mib", type=int, default=16, help="MiB of state per rank, the same on every rank (default 16)"
    )
    parser.add_argument(
        "--store-mbit",
        type=float,
        default=None,
        help="shape the store's loopback traffic to this rate during the restore",
    )
    args = parser.parse_args()
    if find_tool("fake-gcs-server") is None:
        raise SystemExit("fake-gcs-server is neither on PATH nor in .tools/bin; run `make tools`")
    print(
        f"{'DP = ' + str(args.dp) + ', medians':<44}{'read ÷ unique':>14}{'restore s':>11}{'upload share':>14}{'backup s':>10}"
    )
    modes = (("before (today): every node downloads", False), ("after: fan-out, shared upload", True))
    for label, after in modes:
        runs = []
        for _ in range(args.repetitions):
            workdir = tempfile.mkdtemp(prefix="mtc-bench-fan-out-")
            try:
                runs.append(one_run(workdir, args.dp, after, args.ballast_mib, args.store_mbit))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        median = {
            field: statistics.median(getattr(r, field) for r in runs)
            for field in ("read_ratio", "restore_seconds", "upload_share", "backup_seconds")
        }
        verdict = "" if not after else ("  PASS" if median["read_ratio"] <= GOAL + 0.01 else "  ABOVE")
        print(
            f"{label:<44}{median['read_ratio']:>14.2f}{median['restore_seconds']:>11.2f}{median['upload_share']:>14.2f}"
            f"{median['backup_seconds']:>10.2f}{verdict}"
        )
    print(
        f"goals: read ÷ unique = {GOAL} after; upload share 1/{args.dp} after. Unique checkpoint bytes {runs[0].unique_bytes}; "
        f"{args.repetitions} run(s) per mode; store shaped to {args.store_mbit or 'unshaped'} Mbit/s during the restore; "
        f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})."
    )


if __name__ == "__main__":
    main()
