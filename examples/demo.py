"""``make demo``: a real JAX + Orbax job checkpoints through every tier and survives three failures.

On this machine, with nothing to set up: a coordinator and four node agents on loopback
(2 slices x 2 nodes; tmpfs ramdisks when run as root, directories otherwise; peer tier on; backups
to an embedded ``file://`` store), four pods published as kubelet would, and ``examples/train.py``
running Orbax's multi-tier checkpointing path. ``--framework pytorch`` (``make demo
FRAMEWORK=pytorch``) runs a PyTorch job instead: two nodes, each a torchrun pod with two local ranks
of ``examples/train_torch.py`` (FSDP2 over gloo) saving through ``mtc_torch``. Then:

1. preemption: every training process is SIGKILLed; the pods are recreated and restore from
   their own ramdisks;
2. node loss: a node dies with its RAM; a fresh node joins and its rank restores from a peer;
3. cluster loss: every node and the coordinator go; fresh nodes restore from the backup tier.

``--backup URL`` points the backup tier at a real store instead (``s3://BUCKET/PREFIX`` with the
``AWS_*`` environment, ``gs://...``): the agents inherit the environment.
"""

import argparse
import collections
import contextlib
import dataclasses
import itertools
import os
import signal
import sys
import time

from examples.local_cluster import LocalCluster, LocalJob, can_mount_tmpfs, scratch_dir
from examples.torchrun_job import TorchrunJob
from replicator.coordinator.api.status import render_status

STEPS = 75
SAVE_EVERY = 5
BACKUP_EVERY = 10


@dataclasses.dataclass
class Outcome:
    """What one failure cost."""

    phase: str
    restored_step: int
    steps_lost: int
    seconds_to_first_step: float
    sources: dict[str, str]
    continued: bool


def banner(text: str) -> None:
    print(f"\n== {text}", flush=True)


def step_events(job: LocalJob) -> dict[int, dict]:
    return {e["step"]: e for pod in job.pods for e in pod.events() if e["event"] == "step"}


def job_status(cluster: LocalCluster, job: LocalJob) -> dict:
    return cluster.coordinator.status(job.job)["jobs"][0]


def committed_everywhere(job: LocalJob) -> int | None:
    """The newest step every pod has committed (a bare integer directory in its local dir)."""
    held = [{int(n) for n in os.listdir(p.target) if n.isdigit()} for p in job.pods]
    return max(set.intersection(*held), default=None)


def train_until(job: LocalJob, step: int) -> dict[int, dict]:
    """Trains past ``step``, then SIGKILLs the job once it has logged a step after the newest step
    committed everywhere (for at most 60 s), so the first step after the restore has a loss from
    before the failure to be compared with. The trainers are SIGSTOPped while that is read."""
    job.wait(lambda: max(step_events(job), default=0) >= step, 300, f"step {step}")
    deadline = time.monotonic() + 60
    while True:
        job.signal_training(signal.SIGSTOP)
        committed = committed_everywhere(job)
        if committed is None or max(step_events(job)) > committed or time.monotonic() > deadline:
            break
        job.signal_training(signal.SIGCONT)
        time.sleep(0.1)
    job.kill_training()
    return step_events(job)


def recreate_and_resume(cluster: LocalCluster, job: LocalJob, phase: str, before: dict[int, dict]) -> Outcome:
    """Deletes and recreates the pods (on ``job.agents``), waits for the first step, reports."""
    job.delete_pods()
    recreated_at = time.time()
    job.create_pods()
    job.start_training()
    job.wait(lambda: step_events(job), 300, "the first step after the restart")
    after = step_events(job)
    first = min(after)
    restore = job_status(cluster, job)["restore"]
    step = restore["step"]
    last = max(before)
    # Continued: the first step is the one after the restored step, with the loss it had before the
    # failure. A first step never logged before the failure compares nothing: not continued.
    compared = first in before
    continued = compared and first == step + 1 and after[first]["loss"] == before[first]["loss"]
    outcome = Outcome(phase, step, last - step, after[first]["time"] - recreated_at, restore["sources"], continued)
    print(
        f"resumed at step {first} after restoring step {step} "
        f"({outcome.steps_lost} steps lost, {outcome.seconds_to_first_step:.1f} s from pod recreation); "
        f"loss at step {first}: {after[first]['loss']:.6f} now, "
        + (
            f"{before[first]['loss']:.6f} before the failure"
            if compared
            else f"HARNESS ERROR: never logged before the failure (steps {min(before)}-{last}), nothing compared"
        )
    )
    print("restore sources: " + ", ".join(f"rank {r}: {s}" for r, s in sorted(restore["sources"].items())))
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backup", help="backup tier URL (default: an embedded file:// store)")
    parser.add_argument(
        "--framework",
        choices=("jax", "pytorch"),
        default="jax",
        help="jax: Orbax on 4 nodes; pytorch: torchrun with 2 local ranks on 2 nodes (make torch-setup)",
    )
    args = parser.parse_args()
    # SIGTERM ends the demo like Ctrl-C does: through scratch_dir's teardown.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with scratch_dir("mtc-demo-") as (workdir, cleanup):
        return run(workdir, cleanup, args.backup, args.framework)


def run(workdir: str, cleanup: contextlib.ExitStack, backup: str | None, framework: str = "jax") -> int:
    """The demo in ``workdir`` with the backup tier ``backup`` (None: a file:// store in it) and the
    ``framework``'s job; ``cleanup`` stops its processes (then everything below ``workdir`` is
    unmounted and removed)."""
    ports = itertools.count(18400)
    backup_url = backup or f"file://{os.path.join(workdir, 'object-store')}"
    cluster = LocalCluster(os.path.join(workdir, "cluster"), lambda host: f"{host}:{next(ports)}", backup=backup_url)
    cleanup.callback(cluster.stop)
    train = [
        "--steps",
        str(STEPS),
        "--save-interval-steps",
        str(SAVE_EVERY),
        "--backup-interval-steps",
        str(BACKUP_EVERY),
        "--step-sleep",
        "0.1",
    ]
    if framework == "pytorch":
        nodes, job = 2, TorchrunJob("demo", [], workdir, train, slices=1, jax_port=next(ports))
    else:
        nodes, job = 4, LocalJob("demo", [], workdir, train)
    cleanup.callback(job.kill_training)
    outcomes = []
    banner(
        f"a coordinator and {nodes} node agents on 127.0.0.1-{nodes} ({'tmpfs' if can_mount_tmpfs() else 'directory'} "
        f"ramdisks, peer tier, backups to {backup_url})"
    )
    job.agents = list(cluster.start(nodes).agents)
    trainers = f"{nodes} torchrun pods of 2 local ranks" if framework == "pytorch" else f"{nodes} pods"
    banner(f"{trainers} train {STEPS} steps: a local checkpoint every {SAVE_EVERY}, a backup every {BACKUP_EVERY}")
    job.create_pods()
    job.start_training()

    before = train_until(job, 22)
    banner(f"1. preemption: every training process of the {nodes} pods SIGKILLed after step {max(before)}")
    outcomes.append(recreate_and_resume(cluster, job, "preemption", before))

    before = train_until(job, 38)
    lost = job.agents[1]
    banner(f"2. node loss after step {max(before)}: {lost.node_id} dies with its ramdisk; a fresh node joins")
    cluster.lose_node(lost)
    job.agents[1] = cluster.add_node(len(cluster.agents), block="b0")
    print(f"{lost.node_id} replaced by {job.agents[1].node_id}")
    outcomes.append(recreate_and_resume(cluster, job, "node loss", before))

    job.wait(lambda: max(job_status(cluster, job)["backups"] or [0]) >= 50, 300, "a backup of step 50")
    before = train_until(job, 56)
    banner(
        f"3. cluster loss after step {max(before)}: every node and the coordinator are gone; "
        f"the backup tier holds steps {job_status(cluster, job)['backups']}"
    )
    for agent in list(job.agents):
        cluster.lose_node(agent)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    first_fresh = len(cluster.agents)
    job.agents[:] = [cluster.add_node(first_fresh + i, block=f"b{i // 2}") for i in range(nodes)]
    outcomes.append(recreate_and_resume(cluster, job, "cluster loss", before))

    job.wait_done(timeout=300)
    print()
    print(render_status(cluster.coordinator.status_struct(job.job)))
    banner("report")
    print(f"{'failure':<14}{'restored':>9}{'lost':>6}{'to 1st step':>13}  {'sources (ranks)':<36}continued")
    for o in outcomes:
        tiers = collections.Counter(source.split(":")[0] for source in o.sources.values())
        sources = ", ".join(f"{tier} x{count}" for tier, count in sorted(tiers.items()))
        print(
            f"{o.phase:<14}{o.restored_step:>9}{o.steps_lost:>6}{o.seconds_to_first_step:>12.1f}s  {sources:<36}{o.continued}"
        )
    final = step_events(job)[STEPS]["loss"]
    print(
        f"final loss at step {STEPS}: {final:.6f}; training continued after every failure: {all(o.continued for o in outcomes)}"
    )
    return 0 if all(o.continued for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
