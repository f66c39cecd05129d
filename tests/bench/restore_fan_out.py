"""Read-once restores: object-store reads and restore time of a cluster-loss restore, every node
downloading (``--no-restore-fan-out``, today's figure, first) against fan-out, in the same run.

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
  marker written, which waits for every rank), the median over ``--repetitions`` restores.

With ``--store-mbit`` the store's loopback traffic is shaped to that rate, as a bucket that is the
bottleneck would be. Run: ``python -m tests.bench.restore_fan_out [--dp 4] [--repetitions 1] [--ballast-mib 16] [--store-mbit R]``.
"""

import argparse
import contextlib
import os
import re
import shutil
import statistics
import tempfile
import time
import warnings

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, unmount_all_below  # noqa: E402
from replicator.backup_tier.store import RankManifest  # noqa: E402
from tests.helpers import network  # noqa: E402
from tests.helpers.agents import scrape  # noqa: E402
from tests.helpers.jobs import UNTIL_KILLED, kill_past_newest_commit, kill_started_jobs, recreate, run_job, status_of  # noqa: E402
from tests.helpers.polling import wait_until  # noqa: E402
from tests.helpers.ports import listen_address  # noqa: E402
from tests.helpers.servers import FakeGcsServer  # noqa: E402
from tests.helpers.tools import find_tool  # noqa: E402

GOAL = 1.0
_RESTORE_SUM = re.compile(r'^mtc_restore_seconds_sum\{source="(\w+)"\} (\S+)$', re.MULTILINE)


def restore_seconds(agent) -> float:
    """Seconds the agent's one restore took (its ``mtc_restore_seconds`` sum over sources)."""
    return sum(float(value) for _, value in _RESTORE_SUM.findall(scrape(agent.url)))


def one_restore(workdir: str, dp: int, fan_out: bool, ballast_mib: int, store_mbit: float | None) -> tuple[float, float, int]:
    """Trains, backs up, loses every node and restores once. Returns (store bytes read ÷ unique
    bytes, restore seconds, unique bytes)."""
    with contextlib.ExitStack() as cleanup:
        server = FakeGcsServer(find_tool("fake-gcs-server"), request_log=os.path.join(workdir, "gcs-requests.log")).start()
        cleanup.callback(server.stop)
        bucket = server.client().create_bucket("ckpt")
        cluster = LocalCluster(os.path.join(workdir, "cluster"), listen_address, backup="gs://ckpt/mtc",
                               env={"STORAGE_EMULATOR_HOST": server.url})  # fmt: skip
        cluster.coordinator.extra_args += ["--holder-grace-seconds", "5", *([] if fan_out else ["--no-restore-fan-out"])]
        cleanup.callback(unmount_all_below, workdir)
        cleanup.callback(cluster.stop)
        cleanup.callback(kill_started_jobs)
        cluster.start(dp)
        job = run_job("fan", list(cluster.agents), os.path.join(workdir, "job"), [*UNTIL_KILLED, "--dump-dir", os.path.join(workdir, "dump"),
                      "--ballast-mib", str(ballast_mib), "--ballast-per-slice"], slices=dp)  # fmt: skip

        def identical_backup():
            status = status_of(cluster, job)
            return status["backups"] and status["backup_pending"] is None and len(status["identical_peers"]) == dp * (dp - 1)

        job.wait(identical_backup, 300, "a backup of a step whose ranks were found identical")
        kill_past_newest_commit(job)
        wait_until(lambda: status_of(cluster, job)["backup_pending"] is None, 60, "backups settled")
        step = max(status_of(cluster, job)["backups"])
        for agent in list(job.agents):
            cluster.lose_node(agent)
        fresh = [cluster.add_node(dp + i, block=f"b{i}") for i in range(dp)]
        prefix = f"mtc/default/{job.job}/steps/{step}/"
        shaped = network.rate_limited([network.Endpoint("127.0.0.1", server.port)], store_mbit) if store_mbit else contextlib.nullcontext()
        with shaped:
            recreate(job, os.path.join(workdir, "dump-2"), agents=fresh, steps=step + 2)
            wait_until(lambda: all(restore_seconds(a) > 0 for a in fresh), 280, "every rank restored")
        seconds = max(restore_seconds(a) for a in fresh)
        sizes = {blob.name: blob.size for blob in bucket.list_blobs(prefix=prefix)}
        read = sum(n * sizes[name] for name, n in server.object_reads("ckpt", prefix).items() if "/" in name[len(prefix):])
        manifest = RankManifest.from_json(bucket.blob(f"{prefix}rank-0.manifest.json").download_as_text())
        unique = sum(f.size for f in manifest.files.values())
        job.wait_done(timeout=240)
        return read / unique, seconds, unique


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=4, help="data parallelism: slices of one node each (default 4)")
    parser.add_argument("--repetitions", type=int, default=1, help="restores per mode (default 1)")
    parser.add_argument("--ballast-mib", type=int, default=16, help="MiB of state per rank, the same on every rank (default 16)")
    parser.add_argument("--store-mbit", type=float, default=None, help="shape the store's loopback traffic to this rate")
    args = parser.parse_args()
    if find_tool("fake-gcs-server") is None:
        raise SystemExit("fake-gcs-server is neither on PATH nor in .tools/bin; run `make tools`")
    print(f"{'cluster-loss restore, DP = ' + str(args.dp):<34}{'read ÷ unique':>14}{'restore s':>11}")
    for label, fan_out in (("every node downloads (before)", False), ("fan-out", True)):
        runs = []
        for _ in range(args.repetitions):
            workdir = tempfile.mkdtemp(prefix="mtc-bench-fan-out-")
            try:
                runs.append(one_restore(workdir, args.dp, fan_out, args.ballast_mib, args.store_mbit))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        ratio, seconds = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        verdict = "" if not fan_out else ("  PASS" if ratio <= GOAL + 0.01 else "  ABOVE")
        print(f"{label:<34}{ratio:>14.2f}{seconds:>11.2f}{verdict}")
    print(f"goal: read ÷ unique = {GOAL} with fan-out; unique checkpoint bytes {runs[0][2]}; medians of {args.repetitions}; "
          f"store shaped to {args.store_mbit or 'unshaped'} Mbit/s; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).")


if __name__ == "__main__":
    main()
