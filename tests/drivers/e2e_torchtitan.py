"""``make e2e-torchtitan``: the stock TorchTitan 0.3.0 trainer checkpoints through mtc, unchanged.

Not part of ``make test``: it needs TorchTitan, which the PyTorch virtualenv holds (``make`` installs
``.venv-torch``) and takes minutes. On this machine a coordinator and 2 node agents run as a
LocalCluster (tmpfs ramdisks as root, peer tier on), 2 pods are published as kubelet would (volume
attribute ``framework: pytorch.distributed``), and each runs ``torchrun --nnodes 2
--nproc-per-node 2 --node-rank <pod index>`` (static rendezvous on 127.0.0.1, gloo) of
``python -m torchtitan.train --module examples.torchtitan --config llama3_debugmodel_mtc``: TorchTitan's
llama3 debug model, FSDP over the 4 processes, with its checkpoint section swapped for
``mtc_torch.torchtitan.MtcCheckpointManager`` (TorchTitan's pluggable ``BaseCheckpointManager``).
Only flags are added: the pod's mount, a shorter sequence and batch for 2 shared cores, and the
offline assets (a tokenizer and a text dataset made at test time by ``tests/torchtitan/assets.py``;
TorchTitan's wheel ships neither). The trainers get the CPU-only shim
(``tests/torchtitan/sitecustomize.py``), which also records each step's loss in full. Then:

1. preemption: every process of both pods (torchrun and its workers) is SIGKILLed and the pods
   recreated; each node restores its own copy;
2. node loss: the same, and node 1 dies with its RAM, a fresh node takes its place; node rank 1
   restores from node 0's replica.

Each time it checks that every local rank logs ``mtc: restored step S``, S the newest step every
node had committed before the failure, that training goes on at S + 1, and that the losses logged
after the restore equal, bit for bit, those the killed run logged for the same steps (an empty
comparison is a harness error). The report gives the seconds from the republish to the first step,
and the step time with and without checkpointing (an uninterrupted run of each, before the
failures). Exit status 0 when every check passed.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from examples.local_cluster import LocalCluster, Pod, can_mount_tmpfs
from examples.torchrun_job import TorchrunJob
from tests.helpers.ports import free_port, listen_address
from tests.helpers.trainer_oracle import (
    HarnessError,
    Restore,
    TrainerJob,
    preempt_then_lose_a_node,
)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM_DIR = os.path.join(_REPO_ROOT, "tests", "torchtitan")
TRAINER = "torchtitan.train"
REGISTRY = ("examples.torchtitan", "llama3_debugmodel_mtc")
INTERVAL = 2  # steps between checkpoints
# A step of the debug model is ~50 MB per node (2 ranks, model and AdamW state); the ramdisk holds a few
# own steps and the peer's replicas (256Mi ran out: HTTP 507 on the replication PUTs).
RAMDISK = "1Gi"
# Flags for 2 shared cores: the debug model as TorchTitan defines it, shorter sequences and batches.
FLAGS = [
    "--training.seq-len",
    "128",
    "--training.local-batch-size",
    "2",
    "--debug.seed",
    "0",
    "--metrics.disable-color-printing",
    "--checkpoint.interval",
    str(INTERVAL),
    "--checkpoint.backup-interval-minutes",
    "1",
]
RESTORED = re.compile(r"mtc: restored step (\d+)")
FRESH = "mtc: no checkpoint to restore"


@dataclasses.dataclass
class TitanJob(TorchrunJob, TrainerJob):
    """A TorchrunJob whose pods run the stock TorchTitan trainer; ``train_args`` are its flags.

    Attributes:
      assets: the directory ``tests/torchtitan/assets.py`` wrote (``tokenizer/``, ``dataset/``).
    """

    assets: str = ""

    def loss_dir(self) -> str:
        """Where this incarnation's trainers record their losses (one file per global rank)."""
        return os.path.join(self.workdir, "losses", f"i{self.incarnations}")

    def worker_command(self, pod: Pod) -> list[str]:
        return [
            "-m",
            TRAINER,
            "--module",
            REGISTRY[0],
            "--config",
            REGISTRY[1],
            "--hf-assets-path",
            os.path.join(self.assets, "tokenizer"),
            "--dataloader.dataset-path",
            os.path.join(self.assets, "dataset"),
            "--dump-folder",
            os.path.join(self.workdir, "output", pod.name),
            "--checkpoint.local-dir",
            pod.target,
            "--checkpoint.job-name",
            self.job,
            *self.train_args,
        ]

    def train_env(self) -> dict[str, str]:
        os.makedirs(self.loss_dir(), exist_ok=True)
        return {
            **super().train_env(),
            "PYTHONPATH": os.pathsep.join([SHIM_DIR, _REPO_ROOT]),
            "MTC_TORCHTITAN_CPU_SHIM": "1",
            "MTC_TORCHTITAN_LOSS_DIR": self.loss_dir(),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }

    def losses(self, pod: Pod) -> dict[int, float]:
        """Step -> loss as the node's local rank 0 recorded it (every rank logs the same global loss)."""
        path = os.path.join(self.loss_dir(), f"loss-rank{self.pods.index(pod) * self.nproc_per_node}.jsonl")
        try:
            with open(path, encoding="utf-8") as f:
                records = [
                    json.loads(line) for line in f if line.endswith("\n")
                ]  # a line without its newline is being written
        except FileNotFoundError:
            return {}
        return {int(r["step"]): r["loss"] for r in records}

    def restore_log(self, pod: Pod) -> int | None | str:
        """The step every local rank logged restoring, None for a fresh start, "" before all logged either."""
        text = trainer_log(pod)
        restored = {int(s) for s in RESTORED.findall(text)}
        fresh = text.count(FRESH)
        if len(RESTORED.findall(text)) + fresh < self.nproc_per_node:
            return ""
        if fresh and not restored:
            return None
        return restored.pop() if len(restored) == 1 and not fresh else f"mixed: {sorted(restored)}, {fresh} fresh"


def trainer_log(pod: Pod) -> str:
    """What the pod's torchrun and its workers printed (TorchTitan logs to stdout, torchrun to stderr)."""
    text = ""
    for path in (pod.log_path, pod.log_path + ".stderr"):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text += f.read()
        except FileNotFoundError:
            pass
    return text


def make_assets(python: str, directory: str) -> None:
    """Writes the tokenizer and dataset with the TorchTitan virtualenv's Python (it holds ``tokenizers``)."""
    subprocess.run(
        [python, "-m", "tests.torchtitan.assets", directory], cwd=_REPO_ROOT, check=True, capture_output=True
    )


def step_seconds(job: TitanJob, first: int, last: int) -> float:
    """Mean seconds per step from step ``first`` to step ``last`` as node 0's trainer logged them.

    Raises:
      HarnessError: either step was not logged.
    """
    stamps = step_stamps(job.pods[0])
    if first not in stamps or last not in stamps:
        raise HarnessError(f"steps {first} and {last} not both logged (logged: {sorted(stamps)})")
    return (stamps[last] - stamps[first]) / (last - first)


_STEP_LINE = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* step:\s+(\d+)\s+loss:", re.MULTILINE)


def step_stamps(pod: Pod) -> dict[int, float]:
    """Step -> wall time (s) TorchTitan logged it (its logger's millisecond timestamps)."""
    text = trainer_log(pod)
    stamps = {}
    for stamp, step in _STEP_LINE.findall(text):
        stamps[int(step)] = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1000
    return stamps


def measure_step_time(python: str, assets: str, workdir: str, checkpointing: bool, steps: int) -> float:
    """Mean step time (s) of an uninterrupted 2x2 run of ``steps`` steps, with or without mtc checkpoints."""
    cluster = LocalCluster(workdir, listen_address)
    flags = [*FLAGS, "--training.steps", str(steps)] + ([] if checkpointing else ["--checkpoint.no-enable"])
    job = TitanJob(
        "titanbench",
        [],
        workdir,
        flags,
        slices=1,
        size=RAMDISK,
        jax_port=free_port("127.0.0.1"),
        python=python,
        assets=assets,
    )
    try:
        job.agents = list(cluster.start(2).agents)
        job.create_pods()
        job.start_training()
        job.wait_done(job.wait_timeout)
        return step_seconds(job, 3, steps)  # steps 1-3 include the first collectives and the first save
    finally:
        job.kill_training()
        cluster.stop()


def run(python: str, assets: str, workdir: str) -> list[Restore]:
    """One 2-node job of 2 processes per node through a preemption and a node loss."""
    cluster = LocalCluster(workdir, listen_address)
    job = TitanJob(
        "titan",
        [],
        workdir,
        [*FLAGS, "--training.steps", "100000"],
        slices=1,
        size=RAMDISK,
        jax_port=free_port("127.0.0.1"),
        python=python,
        assets=assets,
    )
    print(
        f"== 2 nodes x {job.nproc_per_node} processes: torchrun ... -m {TRAINER} --module {REGISTRY[0]} --config {REGISTRY[1]} "
        f"{' '.join(FLAGS)} + assets, dump folder and ramdisk per pod",
        flush=True,
    )
    return preempt_then_lose_a_node(
        cluster, 2, job, "2x2", 2 * INTERVAL + 1, (4 * INTERVAL + 1, 6 * INTERVAL + 1), "the trainers"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--python",
        default=os.path.join(_REPO_ROOT, ".venv-torch", "bin", "python"),
        help="Python of the TorchTitan virtualenv (default: the one `make e2e-torchtitan` installs).",
    )
    parser.add_argument(
        "--bench-steps",
        type=int,
        default=12,
        help="Steps of each uninterrupted run timing a step with and without checkpointing (0: skip).",
    )
    args = parser.parse_args()
    if not os.access(args.python, os.X_OK):
        parser.error(f"{args.python} is not executable: run `make e2e-torchtitan`, which installs TorchTitan")
    print(f"ramdisks: {'tmpfs' if can_mount_tmpfs() else 'directories (not root)'}", flush=True)
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="mtc-e2e-torchtitan-")
    results, errors, times = [], [], {}
    try:
        assets = os.path.join(workdir, "assets")
        make_assets(args.python, assets)
        if args.bench_steps:
            for checkpointing in (False, True):
                label = f"checkpoint every {INTERVAL} steps" if checkpointing else "no checkpointing"
                times[label] = measure_step_time(
                    args.python,
                    assets,
                    os.path.join(workdir, f"bench-{checkpointing}"),
                    checkpointing,
                    args.bench_steps,
                )
                print(f"   step time, {label}: {times[label]:.3f} s (mean of steps 4-{args.bench_steps})", flush=True)
        try:
            results = run(args.python, assets, os.path.join(workdir, "job"))
        except HarnessError as err:
            errors.append(str(err))
            print(f"   HARNESS ERROR: {err}", flush=True)
    finally:
        passed = len(results) == 2 and all(r.passed for r in results) and not errors
        if passed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs of the agents and trainers kept in {workdir}", flush=True)
    print(
        "\n== report: TorchTitan 0.3.0 (llama3 debug model, FSDP, gloo) on CPU, 2 nodes x 2 processes on 2 node agents"
    )
    print(f"{'failure':<12}{'newest':>7}{'restored':>10}{'steps compared':>16}{'to 1st step':>13}{'agents':>9}  result")
    for r in results:
        restored = "/".join(str(s) for s in r.logged_steps)
        compared = f"{r.compared_steps[0]}-{r.compared_steps[-1]}" if r.compared_steps else "none"
        print(
            f"{r.failure:<12}{r.newest_step:>7}{restored:>10}{compared:>16}{r.seconds_to_first_step:>12.1f}s"
            f"{r.agent_seconds:>8.3f}s  {'ok' if r.passed else 'HARNESS ERROR' if r.harness_error else 'FAILED'}"
        )
    for error in errors:
        print(f"HARNESS ERROR {error}")
    for label, seconds in times.items():
        print(f"step time, {label}: {seconds:.3f} s")
    print(
        f"{sum(r.passed for r in results)} passed, {len(results) - sum(r.passed for r in results)} failed, "
        f"{sum(r.harness_error is not None for r in results) + len(errors)} harness error(s); {time.monotonic() - started:.0f} s in all"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
