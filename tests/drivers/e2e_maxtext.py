"""``make e2e-maxtext``: the stock MaxText trainer checkpoints through mtc, unchanged.

Not part of ``make test``: it needs MaxText 0.2.5 in its own Python 3.12 virtualenv (``make``
installs it) and takes minutes. On this machine, for each job shape asked for (``--slices 1``:
one slice of 2 nodes, model sharded across them; ``--slices 2``: two data-parallel slices of one
node), a coordinator and 2 node agents run as a LocalCluster (tmpfs ramdisks as root, peer tier
on), 2 pods are published as kubelet would, and each runs
``python -m maxtext.trainers.pre_train.train`` on CPU with the flags of
``examples/maxtext/jobset.yaml``. Only the flags that name places and periods are changed for this
machine; a tiny model and ``dataset_type=synthetic`` are added. The trainers get the CPU-only shim
(``examples/maxtext/sitecustomize.py``). Then:

1. preemption: both trainers are SIGKILLed and the pods recreated; each node restores its own copy;
2. node loss: the trainers are SIGKILLed, node 1 dies with its RAM, a fresh node takes its place,
   and the pods are recreated; rank 1 restores from node 0 (its peer replica, or with two slices
   its data-parallel peer's identical data).

Each failure comes only once every rank's newest commit is the same step and every trainer has
logged the loss of a step after it (MaxText writes a step's loss to its ``metrics_file`` one step
late): the trainers are SIGSTOPped, the condition is read from their ramdisks and metrics files,
and they are SIGKILLed if it holds (resumed and polled again if not, for at most
``KILL_TIMEOUT``). So the killed run has losses to compare with. Each time it checks that every trainer logs ``restoring from this run's
directory step S`` where S is the newest step every rank had committed before the failure, that
training goes on at step S + 1, and that the losses MaxText writes to its ``metrics_file`` after the
restore equal, bit for bit, those it wrote before the failure for the same steps. A pod with no step
logged both before the failure and after the restore is a harness error (the row fails and says
so): an empty comparison proves nothing. The closing report gives, per restore,
the seconds from the pods' republish to the first step and the agents' share of them (from
replicator.yaml consumed to restore marker written, ``mtc_restore_seconds`` on every agent).
Exit status 0 when every check passed.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

import yaml

from examples.local_cluster import LocalCluster, Pod, can_mount_tmpfs
from tests.helpers.ports import free_port, listen_address
from tests.helpers.trainer_oracle import (
    HarnessError,
    Restore,
    TrainerJob,
    preempt_then_lose_a_node,
)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXAMPLE_DIR = os.path.join(_REPO_ROOT, "examples", "maxtext")
JOBSET = os.path.join(_EXAMPLE_DIR, "jobset.yaml")
TRAINER = "maxtext.trainers.pre_train.train"

# The multi-tier checkpointing flags the JobSet must carry; the e2e replaces only the values that
# name places (the pod's mount, the output directory) or are too long for a test.
MTC_FLAGS = (
    "enable_multi_tier_checkpointing",
    "local_checkpoint_directory",
    "local_checkpoint_period",
    "multi_tier_checkpointing_backup_interval_minutes",
)
LOCAL_PERIOD = 2
# A model small enough for 2 CPU processes on 2 shared cores; random tokens (no dataset download).
TINY_MODEL = {
    "dataset_type": "synthetic",
    "base_emb_dim": "64",
    "base_num_decoder_layers": "2",
    "base_mlp_dim": "128",
    "base_num_query_heads": "2",
    "base_num_kv_heads": "2",
    "head_dim": "32",
    "max_target_length": "64",
    "per_device_batch_size": "1",
    "vocab_size": "256",
    "steps": "100000",
    "enable_tensorboard": "False",
}
# Set per pod by MaxTextJob.train_command.
POD_FLAGS = ("run_name", "local_checkpoint_directory", "base_output_directory", "metrics_file")
RESTORED = re.compile(r"restoring from this run's directory step (\d+)")
FRESH = "No existing checkpoints found"


def jobset_flags(path: str = JOBSET) -> dict[str, str]:
    """The ``key=value`` flags of the JobSet's ``train`` container, in order.

    Raises:
      ValueError: the container does not run ``python -m maxtext.trainers.pre_train.train`` or
        lacks a multi-tier checkpointing flag.
    """
    with open(path, encoding="utf-8") as f:
        jobset = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "JobSet")
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = next(c for c in pod_spec["containers"] if c["name"] == "train")
    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
    if argv[1:3] != ["-m", TRAINER]:
        raise ValueError(f"{path}: the train container runs {argv[:3]}, not python -m {TRAINER}")
    flags = dict(arg.split("=", 1) for arg in argv[3:])
    missing = [f for f in MTC_FLAGS if f not in flags]
    if missing or flags["enable_multi_tier_checkpointing"] != "True":
        raise ValueError(
            f"{path}: multi-tier checkpointing flags missing or off: {missing or flags['enable_multi_tier_checkpointing']}"
        )
    return flags


@dataclasses.dataclass
class MaxTextJob(TrainerJob):
    """A LocalJob whose pods run the stock MaxText trainer; ``train_args`` are its ``key=value`` flags."""

    python: str = "python3.12"

    @staticmethod
    def metrics_path(pod: Pod) -> str:
        return pod.log_path + ".metrics"

    @staticmethod
    def stderr_path(pod: Pod) -> str:
        return pod.log_path + ".stderr"

    def train_command(self, pod: Pod) -> list[str]:
        pod_flags = dict(
            zip(
                POD_FLAGS,
                (self.name, pod.target, os.path.join(self.workdir, "output", pod.name), self.metrics_path(pod)),
            )
        )
        flags = {**dict(arg.split("=", 1) for arg in self.train_args), **pod_flags}
        return [self.python, "-m", TRAINER, *(f"{k}={v}" for k, v in flags.items())]

    def train_env(self) -> dict[str, str]:
        return {**super().train_env(), "PYTHONPATH": _EXAMPLE_DIR, "MTC_NUM_SLICES": str(self.slices)}

    def losses(self, pod: Pod) -> dict[int, float]:
        """Step -> ``learning/loss`` as MaxText wrote it (full float precision) to ``metrics_file``."""
        try:
            with open(self.metrics_path(pod), encoding="utf-8") as f:
                # A line without its newline is still being written.
                records = [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return {}
        return {int(r["step"]): r["learning/loss"] for r in records}

    def restore_log(self, pod: Pod) -> int | None | str:
        """The step MaxText logged restoring, None for a fresh start, "" before either was logged."""
        with open(self.stderr_path(pod), encoding="utf-8", errors="replace") as f:
            text = f.read()
        found = RESTORED.search(text)
        return int(found.group(1)) if found else (None if FRESH in text else "")


def run_shape(python: str, slices: int, workdir: str) -> list[Restore]:
    """One job of 2 pods in ``slices`` slices through a preemption and a node loss."""
    shape = f"{slices}x{2 // slices}"
    flags = {
        **jobset_flags(),
        "local_checkpoint_period": str(LOCAL_PERIOD),
        "multi_tier_checkpointing_backup_interval_minutes": "1",
        **TINY_MODEL,
    }
    cluster = LocalCluster(workdir, listen_address)
    job = MaxTextJob(
        "maxtext",
        [],
        workdir,
        [f"{k}={v}" for k, v in flags.items()],
        slices=slices,
        size="256Mi",
        jax_port=free_port("127.0.0.1"),
        python=python,
    )
    shown = " ".join(arg for arg in job.train_args if arg.split("=", 1)[0] not in POD_FLAGS)
    print(
        f"== {shape} ({slices} slice(s) x {2 // slices} node(s)): python -m {TRAINER} {shown} + {', '.join(POD_FLAGS)} per pod",
        flush=True,
    )
    return preempt_then_lose_a_node(cluster, 2, job, shape, 9, (19, 29), "MaxText")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--python",
        default=os.path.join(_REPO_ROOT, ".venv-maxtext", "bin", "python"),
        help="Python of the MaxText virtualenv (default: the one `make e2e-maxtext` installs).",
    )
    parser.add_argument(
        "--slices",
        type=int,
        nargs="+",
        default=[1, 2],
        choices=[1, 2],
        help="Job shapes to run: 2 pods in 1 slice, 2 slices, or both (default).",
    )
    args = parser.parse_args()
    if not os.access(args.python, os.X_OK):
        parser.error(f"{args.python} is not executable: run `make e2e-maxtext`, which installs MaxText")
    print(f"ramdisks: {'tmpfs' if can_mount_tmpfs() else 'directories (not root)'}", flush=True)
    results, errors = [], []
    workdir = tempfile.mkdtemp(prefix="mtc-e2e-maxtext-")
    try:
        for slices in args.slices:
            try:
                results += run_shape(args.python, slices, os.path.join(workdir, f"slices-{slices}"))
            except HarnessError as err:
                errors.append(f"{slices}x{2 // slices}: {err}")
                print(f"   HARNESS ERROR: {err}", flush=True)
    finally:
        if len(results) == 2 * len(args.slices) and all(r.passed for r in results):
            shutil.rmtree(workdir)
        else:
            print(f"logs of the agents and trainers kept in {workdir}", flush=True)
    print("\n== report: MaxText 0.2.5 on CPU, 2 pods on 2 node agents")
    print(
        f"{'shape':<6}{'failure':<12}{'newest':>7}{'restored':>10}{'steps compared':>16}{'to 1st step':>13}{'agents':>9}{'share':>7}  result"
    )
    for r in results:
        restored = "/".join(str(s) for s in r.logged_steps)
        compared = f"{r.compared_steps[0]}-{r.compared_steps[-1]}" if r.compared_steps else "none"
        print(
            f"{r.shape:<6}{r.failure:<12}{r.newest_step:>7}{restored:>10}{compared:>16}"
            f"{r.seconds_to_first_step:>12.1f}s{r.agent_seconds:>8.3f}s{r.agent_seconds / r.seconds_to_first_step:>7.1%}  "
            f"{'ok' if r.passed else 'HARNESS ERROR' if r.harness_error else 'FAILED'}"
        )
    for error in errors:
        print(f"HARNESS ERROR {error}")
    firsts = [r.seconds_to_first_step for r in results]
    agents = [r.agent_seconds for r in results]
    if results:
        print(
            f"republish to first step: median {statistics.median(firsts):.1f} s (range {min(firsts):.1f}-{max(firsts):.1f} s); "
            f"agents (replicator.yaml consumed to restore marker): median {statistics.median(agents):.3f} s "
            f"(range {min(agents):.3f}-{max(agents):.3f} s); the rest is MaxText's import and XLA compile, and Orbax's 1 s polls"
        )
    # Every shape asked for ran both failures, and each compared at least one step per pod.
    passed = len(results) == 2 * len(args.slices) and all(r.passed for r in results)
    print(
        f"{sum(r.passed for r in results)} passed, {len(results) - sum(r.passed for r in results)} failed, "
        f"{sum(r.harness_error is not None for r in results) + len(errors)} harness error(s)"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
