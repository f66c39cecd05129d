"""An elastic restore from RAM beside a same-size restore and a restore from the backup tier, for the same PyTorch job
in the same run (issue 50: elastic from RAM <= 1.5 x the same-size restore).

One cluster: a coordinator, real ``mtc node`` agents on loopback (tmpfs ramdisks, the peer tier, a file backup store)
and the real torchrun job of ``examples/train_torch.py`` (FSDP2 over gloo, 2 local ranks per node, hidden width
HIDDEN: about 12 x HIDDEN^2 bytes of model and AdamW state in all), saving every SAVE_EVERY steps and backing up every
save. Each repetition, once the newest step is replicated (and, before the backup restore, backed up), the training
processes are SIGKILLed and the pods recreated:

- same size: on the same 2 nodes; every node restores its own step from its ramdisk (sources ``local``);
- elastic, 2 -> 3: a third node joins; every node stages both old nodes' copies (own ramdisk or a peer) under
  ``.mtc-resharded-<S>/`` and ``mtc_torch.StepReader`` loads them into 6 ranks;
- elastic, 3 -> 2: back to 2 nodes (3 old nodes' copies, each node the overlap and its neighbours);
- backup: every node is lost and 2 fresh ones join; each restores from the backup tier (then the next repetition
  runs on those).

Timed from the pods' recreation to the job's first step (torchrun's start-up, the hand-shake, the staging, the load
and one step), with the agents' ``mtc_restore_seconds`` (``replicator.yaml`` consumed to the marker: the staging). The coordinator's sources are checked (a wrong tier exits 1), the
agents' ``mtc_restore_seconds`` printed. Medians over REPETITIONS. Run as root: ``python -m tests.bench.elastic_restore``.
"""

import os
import statistics
import sys
import time
import warnings

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, can_mount_tmpfs, scratch_dir
from examples.torchrun_job import TorchrunJob
from tests.bench.restore_mttr import restore_seconds, staging_seconds
from tests.helpers.ports import free_port, listen_address

HIDDEN = int(os.environ.get("MTC_BENCH_HIDDEN", "2048"))
SAVE_EVERY = 4
REPETITIONS = int(os.environ.get("MTC_BENCH_REPETITIONS", "3"))
GOAL = 1.5  # elastic from RAM / same size
WAIT_SECONDS = 600.0
TRAIN_ARGS = [
    "--steps", "100000", "--save-interval-steps", str(SAVE_EVERY), "--backup-interval-steps", str(SAVE_EVERY),
    "--hidden", str(HIDDEN), "--step-sleep", "0.2",
]  # fmt: skip
SAME, GROW, SHRINK, BACKUP = "same size", "elastic 2 -> 3", "elastic 3 -> 2", "backup"
RAM_TIERS = ("local", "peer_close", "peer_distant")


class WrongSource(Exception):
    """A restore staged a copy from another tier than the bench measures."""


def events(job: TorchrunJob, kind: str) -> list[dict]:
    return [e for pod in job.pods for e in pod.events() if e["event"] == kind]


def status(cluster: LocalCluster, job: TorchrunJob) -> dict:
    return cluster.coordinator.status(job.job)["jobs"][0]


def train_until_kept(cluster: LocalCluster, job: TorchrunJob, backed_up: bool) -> int:
    """Lets the job save a step newer than its restored one, replicated (and backed up if ``backed_up``); kills it."""
    start = max((e["step"] for e in events(job, "step")), default=0)

    def kept() -> bool:
        s = status(cluster, job)
        newest = s["newest_complete_step"]
        return (
            newest is not None
            and newest > start
            and s["safe_step"] == newest
            and (not backed_up or newest in s["backups"])
        )

    job.wait(kept, WAIT_SECONDS, "a replicated step" + (" backed up" if backed_up else ""))
    job.kill_training()
    return status(cluster, job)["newest_complete_step"]


def recreate(job: TorchrunJob, agents) -> float:
    """Recreates the pods on ``agents``; returns seconds from recreation to the first step."""
    job.delete_pods()
    job.agents[:] = agents
    recreated_at = time.time()
    job.create_pods()
    job.start_training()
    job.wait(lambda: events(job, "step"), WAIT_SECONDS, "the first step after the restart")
    return min(e["time"] for e in events(job, "step")) - recreated_at


def check_sources(mode: str, sources: dict[str, str], nodes: int) -> None:
    """Raises ``WrongSource`` unless every rank staged from the tier ``mode`` measures."""
    wanted = ("backup",) if mode == BACKUP else ("local",) if mode == SAME else RAM_TIERS
    tiers = [part.split("=")[-1].split(":")[0] for used in sources.values() for part in used.split(",")]
    if len(sources) != nodes or not tiers or any(t not in wanted for t in tiers):
        raise WrongSource(f"{mode}: sources {sources}, wanted {' or '.join(wanted)} on {nodes} nodes")


def run(workdir: str, cleanup) -> list[dict[str, float]]:
    cluster = LocalCluster(workdir, listen_address, replicas=1, backup=f"file://{os.path.join(workdir, 'store')}")
    cleanup.callback(cluster.stop)
    agents = list(cluster.start(3).agents)
    job = TorchrunJob("elastic", agents[:2], os.path.join(workdir, "job"), TRAIN_ARGS, slices=1, size="4Gi",
                      jax_port=free_port("0.0.0.0"))  # fmt: skip
    cleanup.callback(job.kill_training)
    job.create_pods()
    job.start_training()
    samples = []
    for rep in range(REPETITIONS):
        sample = {}
        for mode in (SAME, GROW, SHRINK, BACKUP):
            step = train_until_kept(cluster, job, mode == BACKUP)
            if mode == BACKUP:
                for agent in agents:  # the cluster's live nodes
                    cluster.lose_node(agent)
                agents = [cluster.add_node(len(cluster.agents) + i, block="b0") for i in range(3)]
            nodes = 3 if mode == GROW else 2
            before = [restore_seconds(agent) for agent in agents[:nodes]]
            sample[mode] = recreate(job, agents[:nodes])
            restore = status(cluster, job)["restore"]
            print(
                f"rep {rep} {mode}: step {restore['step']} (kept {step}) restored in {sample[mode]:.1f} s, "
                f"sources {dict(sorted(restore['sources'].items()))}",
                flush=True,
            )
            print(f"  agents' mtc_restore_seconds (node, source, s): {staging_seconds(agents[:nodes], before)}")
            if restore["step"] != step:
                raise WrongSource(f"{mode}: restored step {restore['step']}, not the kept step {step}")
            check_sources(mode, restore["sources"], nodes)
        samples.append(sample)
    job.kill_training()
    cluster.stop()
    return samples


def main() -> int:
    if not can_mount_tmpfs():
        print("note: not root, agents use the dir backend (ramdisks on disk)", file=sys.stderr)
    started = time.monotonic()
    try:
        with scratch_dir("mtc-bench-elastic-") as (workdir, cleanup):
            samples = run(workdir, cleanup)
    except WrongSource as err:
        print(f"wrong source: {err}", file=sys.stderr)
        return 1
    print(
        f"\nmedians of {REPETITIONS} (hidden {HIDDEN}, about {12 * HIDDEN * HIDDEN / 2**20:.0f} MiB of state in all):"
    )
    medians = {mode: statistics.median(s[mode] for s in samples) for mode in (SAME, GROW, SHRINK, BACKUP)}
    for mode, seconds in medians.items():
        print(f"  {mode:15} {seconds:6.1f} s  ({', '.join(f'{s[mode]:.1f}' for s in samples)})")
    for mode in (GROW, SHRINK):
        ratio = medians[mode] / medians[SAME]
        print(f"  {mode} / same size: {ratio:.2f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'missed'})")
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
