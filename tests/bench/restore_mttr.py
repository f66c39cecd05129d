"""Restore time after a node loss against a restore from the job's own ramdisks, with a real Orbax job, in the same run.

A coordinator and four real ``mtc node`` agents on 127.0.0.1-4 (2 slices x 2 nodes, tmpfs
ramdisks, peer tier, one replica per step) run the real 4-process JAX job (``examples/train.py``)
with BALLAST_MIB MiB of state per rank (``--ballast-mib``) and ``--data-parallelism 1``, so every
rank's step is replicated to a node of the other block. Each repetition, on the same cluster:

- local: once every rank's newest saved step has its replica, the training processes are
  SIGKILLed and the pods recreated; every rank restores from its own ramdisk. This is the
  physical limit: Orbax reading its own checkpoint from RAM, JAX start-up and the first step.
- node loss: the same, but node 1 dies with its ramdisk and a fresh node joins; its rank's data
  comes from the peer holding the replica (``fetch_step``, verified) before Orbax reads it.

Both are timed from the pods' recreation to the first training step (rank 0's ``step`` event). The
goal is node loss <= 1.5 x local. Run as root: ``python -m tests.bench.restore_mttr``.
"""

import os
import statistics
import sys
import time
import warnings

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, LocalJob, can_mount_tmpfs, scratch_dir
from tests.helpers.ports import free_port, listen_address

NODES = 4
SLICES = 2
BALLAST_MIB = 512
SAVE_EVERY = 4
REPETITIONS = 1
GOAL = 1.5
WAIT_SECONDS = 600.0
TRAIN_ARGS = [
    "--steps",
    "100000",
    "--save-interval-steps",
    str(SAVE_EVERY),
    "--backup-interval-steps",
    "100000",
    "--data-parallelism",
    "1",
    "--ballast-mib",
    str(BALLAST_MIB),
    "--step-sleep",
    "0.2",
]


def step_times(job: LocalJob) -> dict[int, float]:
    """step -> the time rank 0 reported it, of the current pods."""
    return {e["step"]: e["time"] for pod in job.pods for e in pod.events() if e["event"] == "step"}


def newest_replicated_step(cluster: LocalCluster, job: LocalJob) -> int | None:
    """The newest step every rank holds on at least two nodes (its own and a replica), or None."""
    status = cluster.coordinator.status(job.job)["jobs"]
    if not status:
        return None
    held = status[0]["held"]
    if len(held) < NODES:
        return None
    common = set.intersection(*({int(s) for s, nodes in steps.items() if len(nodes) >= 2} for steps in held.values()))
    return max(common, default=None)


def train_until_replicated(cluster: LocalCluster, job: LocalJob) -> int:
    """Lets the job train until a step newer than its first one is replicated for every rank; kills it; returns that step.
    Killing it at once keeps the ramdisks to about two steps and their replicas."""
    start = max(step_times(job), default=0)
    try:
        job.wait(lambda: (newest_replicated_step(cluster, job) or 0) > start, WAIT_SECONDS, "a replicated step")
    except TimeoutError as err:
        raise TimeoutError(
            f"after step {max(step_times(job), default=0)}, steps held: {cluster.coordinator.status(job.job)['jobs']}"
        ) from err
    job.kill_training()
    return newest_replicated_step(cluster, job)


def recreate(job: LocalJob) -> float:
    """Recreates the pods and starts training; returns seconds from recreation to the first step."""
    job.delete_pods()
    recreated_at = time.time()
    job.create_pods()
    job.start_training()
    job.wait(lambda: step_times(job), WAIT_SECONDS, "the first step after the restart")
    return min(step_times(job).values()) - recreated_at


def main() -> None:
    if not can_mount_tmpfs():
        print("note: not root, agents use the dir backend (ramdisks on disk)", file=sys.stderr)
    samples = []
    with scratch_dir("mtc-bench-mttr-") as (workdir, cleanup):
        cluster = LocalCluster(workdir, listen_address, replicas=1)
        cleanup.callback(cluster.stop)
        job = LocalJob(
            "mttr",
            list(cluster.start(NODES).agents),
            os.path.join(workdir, "job"),
            TRAIN_ARGS,
            slices=SLICES,
            size="4Gi",
            jax_port=free_port("0.0.0.0"),
        )
        cleanup.callback(job.kill_training)
        job.create_pods()
        job.start_training()
        for rep in range(REPETITIONS):
            sample = {}
            for mode in ["local", "node loss"] if rep % 2 == 0 else ["node loss", "local"]:
                step = train_until_replicated(cluster, job)
                if mode == "node loss":
                    cluster.lose_node(job.agents[1])
                    job.agents[1] = cluster.add_node(len(cluster.agents), block="b0")
                sample[mode] = recreate(job)
                restore = cluster.coordinator.status(job.job)["jobs"][0]["restore"]
                print(
                    f"rep {rep} {mode}: step {restore['step']} (replicated {step}) restored in {sample[mode]:.1f} s, "
                    f"sources {dict(sorted(restore['sources'].items()))}",
                    flush=True,
                )
            samples.append(sample)

    local = statistics.median(s["local"] for s in samples)
    lost = statistics.median(s["node loss"] for s in samples)
    ratio = statistics.median(s["node loss"] / s["local"] for s in samples)
    print(f"{'operation':<16}{'node loss s':>12}{'local s':>9}{'ratio':>8}  goal")
    print(
        f"{'restore to step':<16}{lost:>12.1f}{local:>9.1f}{ratio:>8.2f}  <= {GOAL} {'PASS' if ratio <= GOAL else 'BELOW'}"
    )
    print(
        f"medians of {REPETITIONS} repetitions; seconds from pod recreation to the first training step; "
        f"{NODES} JAX processes, {BALLAST_MIB} MiB per rank; node loss restores one rank from a peer's replica. "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )


if __name__ == "__main__":
    main()
