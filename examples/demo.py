"""``make demo``: a real JAX + Orbax job checkpoints through the system, is preempted, and resumes.

On this machine, with nothing to set up: a coordinator and four node agents on loopback
(2 slices x 2 nodes; tmpfs ramdisks when run as root, directories otherwise), four pods published
as kubelet would, and ``examples/train.py`` running Orbax's multi-tier checkpointing path. Every
training process is SIGKILLed mid-run, the pods are deleted and recreated, and the job resumes from
the newest step complete on every rank.
"""

import os
import shutil
import sys
import tempfile
import time

from examples.local_cluster import CoordinatorProcess, LocalJob, NodeAgentProcess, can_mount_tmpfs, unmount_all_below
from replicator.status import fetch_status, render_status

STEPS = 60
SAVE_EVERY = 5
KILL_AFTER_STEP = 27


def banner(text: str) -> None:
    print(f"\n== {text}", flush=True)


def step_events(job: LocalJob) -> list[dict]:
    return [e for pod in job.pods for e in pod.events() if e["event"] == "step"]


def main() -> int:
    workdir = tempfile.mkdtemp(prefix="mtc-demo-")
    backend = "tmpfs" if can_mount_tmpfs() else "dir"
    coordinator = CoordinatorProcess(os.path.join(workdir, "coordinator"), "127.0.0.1:18399")
    agents = [
        NodeAgentProcess(f"node-{i}", os.path.join(workdir, f"node-{i}"), f"127.0.0.{i + 1}:18400", backend,
                         ["--coordinator", coordinator.url, "--pod-address", f"127.0.0.{i + 1}", "--topology", f"block=b{i // 2}"])
        for i in range(4)
    ]  # fmt: skip
    job = LocalJob("demo", agents, workdir, ["--steps", str(STEPS), "--save-interval-steps", str(SAVE_EVERY),
                                             "--backup-interval-minutes", "30", "--step-sleep", "0.1"])  # fmt: skip
    try:
        banner(f"starting a coordinator and 4 node agents on 127.0.0.1-4 (ramdisk backend: {backend})")
        coordinator.start()
        for agent in agents:
            agent.start()
        banner(f"publishing 4 pods and training {STEPS} steps, a local checkpoint every {SAVE_EVERY}")
        job.create_pods()
        job.start_training()
        job.wait(lambda: any(e["step"] >= KILL_AFTER_STEP for e in step_events(job)), 300, f"step {KILL_AFTER_STEP}")
        job.kill_training()
        before = {e["step"]: e["loss"] for e in step_events(job)}
        last_step = max(before)
        banner(f"preemption: SIGKILLed all 4 training processes after step {last_step} (loss {before[last_step]:.6f})")
        time.sleep(1.5)  # let the agents report the last commits
        print(render_status(fetch_status(coordinator.url, job.job)))

        banner("deleting and recreating the pods")
        job.delete_pods()
        recreated_at = time.time()
        job.create_pods()
        job.start_training()
        job.wait_done(timeout=300)
        restored = {pod.name: next(e["step"] for e in pod.events() if e["event"] == "restored") for pod in job.pods}
        after = {e["step"]: e for e in step_events(job)}
        first = min(after)
        status = fetch_status(coordinator.url, job.job)
        print(render_status(status))

        restore = status["jobs"][0]["restore"]
        step = restore["step"]
        banner("report")
        rows = [
            ("restored step (every rank)", f"{sorted(set(restored.values()))}"),
            ("steps lost", f"{last_step - step} (trained to {last_step}, resumed after {step})"),
            ("recreation -> first step", f"{after[first]['time'] - recreated_at:.1f} s"),
            *((f"restore source, rank {rank}", source) for rank, source in sorted(restore["sources"].items(), key=lambda i: int(i[0]))),
            (f"loss at step {step}", f"{before[step]:.6f} (before the kill)"),
            (f"loss at step {first}", f"{after[first]['loss']:.6f} after the restart, {before.get(first, float('nan')):.6f} before"),
            (f"loss at step {STEPS} (final)", f"{after[STEPS]['loss']:.6f}"),
        ]
        continued = first == step + 1 and after[first]["loss"] == before.get(first)
        rows.append(("training continued, not reset", str(continued)))
        for label, value in rows:
            print(f"{label + ':':<32}{value}")
        return 0 if continued and set(restored.values()) == {step} else 1
    finally:
        job.kill_training()
        for process in [*agents, coordinator]:
            process.stop()
        unmount_all_below(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
