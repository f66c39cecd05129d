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
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

import yaml
from prometheus_client.parser import text_string_to_metric_families

from examples.local_cluster import LocalCluster, LocalJob, NodeAgentProcess, Pod, can_mount_tmpfs
from tests.helpers.polling import wait_until
from tests.helpers.ports import free_port, listen_address

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE_DIR = os.path.join(_REPO_ROOT, "examples", "maxtext")
JOBSET = os.path.join(_EXAMPLE_DIR, "jobset.yaml")
TRAINER = "maxtext.trainers.pre_train.train"

# The multi-tier checkpointing flags the JobSet must carry; the e2e replaces only the values that
# name places (the pod's mount, the output directory) or are too long for a test.
MTC_FLAGS = ("enable_multi_tier_checkpointing", "local_checkpoint_directory", "local_checkpoint_period",
             "multi_tier_checkpointing_backup_interval_minutes")  # fmt: skip
LOCAL_PERIOD = 2
# A model small enough for 2 CPU processes on 2 shared cores; random tokens (no dataset download).
TINY_MODEL = {
    "dataset_type": "synthetic", "base_emb_dim": "64", "base_num_decoder_layers": "2", "base_mlp_dim": "128",
    "base_num_query_heads": "2", "base_num_kv_heads": "2", "head_dim": "32", "max_target_length": "64",
    "per_device_batch_size": "1", "vocab_size": "256", "steps": "100000", "enable_tensorboard": "False",
}  # fmt: skip
# Set per pod by MaxTextJob.train_command.
POD_FLAGS = ("run_name", "local_checkpoint_directory", "base_output_directory", "metrics_file")
RESTORED = re.compile(r"restoring from this run's directory step (\d+)")
FRESH = "No existing checkpoints found"
TIMEOUT = 600.0  # seconds for any one wait: MaxText's import and XLA compile take a minute on 2 cores
KILL_TIMEOUT = 120.0  # seconds for the trainers, training, to log a loss past the newest commit (a step takes < 1 s)


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
        raise ValueError(f"{path}: multi-tier checkpointing flags missing or off: {missing or flags['enable_multi_tier_checkpointing']}")
    return flags


@dataclasses.dataclass
class MaxTextJob(LocalJob):
    """A LocalJob whose pods run the stock MaxText trainer; ``train_args`` are its ``key=value`` flags."""

    python: str = "python3.12"

    @staticmethod
    def metrics_path(pod: Pod) -> str:
        return pod.log_path + ".metrics"

    @staticmethod
    def stderr_path(pod: Pod) -> str:
        return pod.log_path + ".stderr"

    def train_command(self, pod: Pod) -> list[str]:
        pod_flags = dict(zip(POD_FLAGS, (self.name, pod.target, os.path.join(self.workdir, "output", pod.name), self.metrics_path(pod))))
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

    def committed(self) -> list[set[int]]:
        """The steps each pod has committed (bare integer directories in its ramdisk)."""
        return [{int(n) for n in os.listdir(p.target) if n.isdigit()} for p in self.pods]

    def newest_step(self) -> int | None:
        """The newest step every pod has committed, None before any."""
        return max(set.intersection(*self.committed()), default=None)

    def kill_past_newest_commit(self, timeout: float = KILL_TIMEOUT) -> tuple[int, list[dict[int, float]]]:
        """SIGKILLs the trainers once every pod has committed the same newest step and logged the
        loss of a step after it; returns that step and each pod's losses.

        The same newest step: a pod that committed a newer step than the others replicates that one
        first, and the step complete everywhere may then never get a copy off its node (the node
        loss would restore an older step). The trainers are SIGSTOPped while the ramdisks and
        metrics files are read, so no commit or loss lands between the check and the kill; if the
        condition does not hold they are resumed and it is polled again.

        Raises:
          HarnessError: not reached within ``timeout`` seconds (the trainers are left running).
        """
        deadline = time.monotonic() + timeout
        while True:
            self.signal_training(signal.SIGSTOP)
            committed, losses = self.committed(), [self.losses(p) for p in self.pods]
            newest = max(set.intersection(*committed), default=None)
            if newest is not None and all(max(c) == newest for c in committed) and logged_past(newest, losses):
                self.kill_training()
                return newest, losses
            self.signal_training(signal.SIGCONT)
            if time.monotonic() > deadline:
                raise HarnessError(f"no moment within {timeout} s when every pod's newest commit was step {newest} and every pod "
                                   f"had logged a loss after it (last: commits {[max(c, default=None) for c in committed]}, "
                                   f"losses {[max(l, default=None) for l in losses]})")  # fmt: skip
            failed = [p for p in self.pods if p.process and p.process.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"training process {failed[0].name} exited {failed[0].process.returncode}: {self._stderr(failed[0])}")
            time.sleep(0.1)

    def train_past(self, step: int) -> None:
        self.wait(lambda: all(max(self.losses(p), default=-1) >= step for p in self.pods), TIMEOUT, f"step {step}")


class HarnessError(RuntimeError):
    """The harness could not set up what it checks (not a verdict on the restore)."""


def logged_past(newest: int, losses: list[dict[int, float]]) -> bool:
    """Whether every pod has logged the loss of a step after ``newest``."""
    return all(max(pod_losses, default=-1) > newest for pod_losses in losses)


@dataclasses.dataclass
class Restore:
    """What one failure and restore looked like."""

    shape: str
    failure: str
    newest_step: int
    logged_steps: list[int | None | str]
    first_steps: list[int | None]
    compared_steps: list[int]
    equal_losses: bool
    seconds_to_first_step: float
    agent_seconds: float
    sources: dict[str, str]
    harness_error: str | None = None

    @property
    def passed(self) -> bool:
        return (self.harness_error is None
                and self.logged_steps == [self.newest_step] * len(self.logged_steps)
                and self.first_steps == [self.newest_step + 1] * len(self.first_steps)
                and bool(self.compared_steps) and self.equal_losses)  # fmt: skip


@dataclasses.dataclass
class LossComparison:
    """The losses of the steps each pod logged both before the failure and after the restore."""

    compared: list[tuple[int, float, float]]  # (step, before, after) over every pod
    differing: list[tuple[int, float, float]]
    harness_error: str | None  # a pod compared nothing: no verdict either way

    @property
    def steps(self) -> list[int]:
        return sorted({s for s, _, _ in self.compared})


def compare_losses(before: list[dict[int, float]], after: list[dict[int, float]]) -> LossComparison:
    """Compares, pod by pod, the losses of the steps logged both before and after; a pod with no
    such step is a harness error, never an equality."""
    compared, empty = [], []
    for pod, (b, a) in enumerate(zip(before, after, strict=True)):
        common = sorted(set(b) & set(a))
        if not common:
            empty.append(f"pod {pod} (before: steps {min(b, default=None)}-{max(b, default=None)}, "
                         f"after: {min(a, default=None)}-{max(a, default=None)})")  # fmt: skip
        compared += [(s, b[s], a[s]) for s in common]
    if not before:
        empty.append("every pod (no pod)")
    error = f"no step's loss logged both before the failure and after the restore by {', '.join(empty)}: nothing compared" if empty else None
    return LossComparison(compared, [(s, b, a) for s, b, a in compared if b != a], error)


def restore_seconds(agent: NodeAgentProcess) -> float:
    """Sum of the agent's ``mtc_restore_seconds`` over every source (seconds)."""
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) if family.name == "mtc_restore_seconds"
               for s in family.samples if s.name == "mtc_restore_seconds_sum")  # fmt: skip


def fail_and_restore(cluster: LocalCluster, job: MaxTextJob, shape: str, lose_node: bool) -> Restore:
    """SIGKILLs the trainers once each logged a loss past the newest commit (and loses node 1 when
    ``lose_node``), recreates the pods, checks the restore."""
    newest, before = job.kill_past_newest_commit()
    status = lambda: cluster.coordinator.status(job.job)["jobs"][0]  # noqa: E731
    wait_until(lambda: status()["newest_complete_step"] == newest, 60, f"the coordinator seeing step {newest}")
    if lose_node:
        # Only a step held elsewhere survives the node: wait until the peer tier covers the newest.
        wait_until(lambda: status()["safe_step"] == newest, 60, f"step {newest} held off node 1")
        lost = job.agents[1]
        cluster.lose_node(lost)
        job.agents[1] = cluster.add_node(len(cluster.agents), block="b0")
        print(f"   {lost.node_id} lost with its ramdisk; {job.agents[1].node_id} joins", flush=True)
    agent_before = [restore_seconds(a) for a in job.agents]
    job.delete_pods()
    republished = time.monotonic()
    job.create_pods()
    job.start_training()
    job.wait(lambda: all(job.losses(p) for p in job.pods), TIMEOUT, "the first step after the restore")
    seconds = time.monotonic() - republished
    job.train_past(max(max(b) for b in before) + 1)
    after = [job.losses(p) for p in job.pods]
    agent_seconds = max(restore_seconds(a) - b for a, b in zip(job.agents, agent_before))
    return judge(shape, "node loss" if lose_node else "preemption", newest, [job.restore_log(p) for p in job.pods],
                 before, after, seconds, agent_seconds, status()["restore"]["sources"])  # fmt: skip


def judge(shape: str, failure: str, newest: int, logged_steps: list[int | None | str], before: list[dict[int, float]],
          after: list[dict[int, float]], seconds: float, agent_seconds: float, sources: dict[str, str]) -> Restore:
    """The oracle of one failure: ``before`` and ``after`` are each pod's losses (step -> loss) of
    the killed run and of the restored one; prints what differs or could not be compared."""
    comparison = compare_losses(before, after)
    if comparison.differing:
        print(f"   losses differ (step, before, after): {comparison.differing[:5]}", flush=True)
    if comparison.harness_error:
        print(f"   HARNESS ERROR: {comparison.harness_error}", flush=True)
    return Restore(shape, failure, newest, logged_steps, [min(a, default=None) for a in after], comparison.steps,
                   not comparison.differing, seconds, agent_seconds, sources, comparison.harness_error)  # fmt: skip


def run_shape(python: str, slices: int, workdir: str) -> list[Restore]:
    """One job of 2 pods in ``slices`` slices through a preemption and a node loss."""
    shape = f"{slices}x{2 // slices}"
    flags = {**jobset_flags(), "local_checkpoint_period": str(LOCAL_PERIOD),
             "multi_tier_checkpointing_backup_interval_minutes": "1", **TINY_MODEL}  # fmt: skip
    cluster = LocalCluster(workdir, listen_address)
    job = MaxTextJob("maxtext", [], workdir, [f"{k}={v}" for k, v in flags.items()], slices=slices,
                     size="256Mi", jax_port=free_port("127.0.0.1"), python=python)  # fmt: skip
    try:
        job.agents = list(cluster.start(2).agents)
        shown = " ".join(arg for arg in job.train_args if arg.split("=", 1)[0] not in POD_FLAGS)
        print(f"== {shape} ({slices} slice(s) x {2 // slices} node(s)): python -m {TRAINER} {shown} + {', '.join(POD_FLAGS)} per pod", flush=True)
        job.create_pods()
        job.start_training()
        job.train_past(9)
        fresh = [job.restore_log(p) for p in job.pods]
        if fresh != [None, None]:
            raise RuntimeError(f"the first run should start fresh (s0 marker), MaxText logged {fresh}")
        results = []
        for lose_node, target in ((False, 19), (True, 29)):
            job.train_past(target)
            result = fail_and_restore(cluster, job, shape, lose_node)
            verdict = f"bit-identical: {result.equal_losses}" if result.harness_error is None else "HARNESS ERROR, nothing compared"
            print(f"   {result.failure}: newest step {result.newest_step}; MaxText restored {result.logged_steps}, "
                  f"resumed at {result.first_steps}; losses of steps {result.compared_steps} {verdict}; first step {result.seconds_to_first_step:.1f} s after the republish, "
                  f"agents {result.agent_seconds:.3f} s; sources {result.sources}", flush=True)  # fmt: skip
            results.append(result)
        return results
    finally:
        job.kill_training()
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=os.path.join(_REPO_ROOT, ".venv-maxtext", "bin", "python"),
                        help="Python of the MaxText virtualenv (default: the one `make e2e-maxtext` installs).")
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="Job shapes to run: 2 pods in 1 slice, 2 slices, or both (default).")  # fmt: skip
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
    print(f"{'shape':<6}{'failure':<12}{'newest':>7}{'restored':>10}{'steps compared':>16}{'to 1st step':>13}{'agents':>9}{'share':>7}  result")
    for r in results:
        restored = "/".join(str(s) for s in r.logged_steps)
        compared = f"{r.compared_steps[0]}-{r.compared_steps[-1]}" if r.compared_steps else "none"
        print(f"{r.shape:<6}{r.failure:<12}{r.newest_step:>7}{restored:>10}{compared:>16}"
              f"{r.seconds_to_first_step:>12.1f}s{r.agent_seconds:>8.3f}s{r.agent_seconds / r.seconds_to_first_step:>7.1%}  "
              f"{'ok' if r.passed else 'HARNESS ERROR' if r.harness_error else 'FAILED'}")  # fmt: skip
    for error in errors:
        print(f"HARNESS ERROR {error}")
    firsts = [r.seconds_to_first_step for r in results]
    agents = [r.agent_seconds for r in results]
    if results:
        print(f"republish to first step: median {statistics.median(firsts):.1f} s (range {min(firsts):.1f}-{max(firsts):.1f} s); "
              f"agents (replicator.yaml consumed to restore marker): median {statistics.median(agents):.3f} s "
              f"(range {min(agents):.3f}-{max(agents):.3f} s); the rest is MaxText's import and XLA compile, and Orbax's 1 s polls")  # fmt: skip
    # Every shape asked for ran both failures, and each compared at least one step per pod.
    passed = len(results) == 2 * len(args.slices) and all(r.passed for r in results)
    print(f"{sum(r.passed for r in results)} passed, {len(results) - sum(r.passed for r in results)} failed, "
          f"{sum(r.harness_error is not None for r in results) + len(errors)} harness error(s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
