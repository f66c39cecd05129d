"""The oracle of the real-trainer end-to-end runs (``make e2e-maxtext``, ``make e2e-torchtitan``).

A :class:`TrainerJob` is a LocalJob whose trainer logs each step's loss in full and its restore; the
harness kills it past the newest step every pod committed (:meth:`TrainerJob.kill_past_newest_commit`),
recreates the pods (after losing a node, for a node loss) and judges the restore
(:func:`fail_and_restore`): the step restored, the first step after it, and the losses of the steps
logged both before the failure and after the restore, bit for bit. An empty comparison is a
:class:`HarnessError`, never a pass.
"""

import dataclasses
import os
import signal
import time
import urllib.request
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families

from examples.local_cluster import LocalCluster, LocalJob, NodeAgentProcess, Pod
from tests.helpers.polling import wait_until


@dataclasses.dataclass
class TrainerJob(LocalJob):
    """A LocalJob whose pods run a real trainer; a subclass says where its losses and restores are logged.

    Attributes:
      wait_timeout: seconds for any one wait on the trainers (imports and compiles included).
      kill_timeout: seconds for the trainers to log a loss past the newest commit.
    """

    wait_timeout: ClassVar[float] = 600.0
    kill_timeout: ClassVar[float] = 120.0

    def losses(self, pod: Pod) -> dict[int, float]:
        """Step -> loss, in full precision, as the pod's trainer logged them."""
        raise NotImplementedError

    def restore_log(self, pod: Pod) -> int | None | str:
        """The step the pod's trainer logged restoring, None for a fresh start, "" before either was logged."""
        raise NotImplementedError

    def committed(self) -> list[set[int]]:
        """The steps each pod has committed (bare integer directories in its ramdisk)."""
        return [{int(n) for n in os.listdir(p.target) if n.isdigit()} for p in self.pods]

    def newest_step(self) -> int | None:
        """The newest step every pod has committed, None before any."""
        return max(set.intersection(*self.committed()), default=None)

    def kill_past_newest_commit(self, timeout: float | None = None) -> tuple[int, list[dict[int, float]]]:
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
        timeout = self.kill_timeout if timeout is None else timeout
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
                raise HarnessError(
                    f"no moment within {timeout} s when every pod's newest commit was step {newest} and every pod "
                    f"had logged a loss after it (last: commits {[max(c, default=None) for c in committed]}, "
                    f"losses {[max(pod_losses, default=None) for pod_losses in losses]})"
                )
            failed = [p for p in self.pods if p.process and p.process.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"training process {failed[0].name} exited {failed[0].process.returncode}: {self._stderr(failed[0])}"
                )
            time.sleep(0.1)

    def train_past(self, step: int) -> None:
        self.wait(
            lambda: all(max(self.losses(p), default=-1) >= step for p in self.pods), self.wait_timeout, f"step {step}"
        )


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

    def describe(self) -> str:
        """One line: what was restored, what was compared and how long the restore took."""
        verdict = (
            f"bit-identical: {self.equal_losses}" if self.harness_error is None else "HARNESS ERROR, nothing compared"
        )
        return (
            f"{self.failure}: newest step {self.newest_step}; restored {self.logged_steps}, resumed at {self.first_steps}; "
            f"losses of steps {self.compared_steps} {verdict}; first step {self.seconds_to_first_step:.1f} s after the "
            f"republish, agents {self.agent_seconds:.3f} s; sources {self.sources}"
        )

    @property
    def passed(self) -> bool:
        return (
            self.harness_error is None
            and self.logged_steps == [self.newest_step] * len(self.logged_steps)
            and self.first_steps == [self.newest_step + 1] * len(self.first_steps)
            and bool(self.compared_steps)
            and self.equal_losses
        )


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
            empty.append(
                f"pod {pod} (before: steps {min(b, default=None)}-{max(b, default=None)}, "
                f"after: {min(a, default=None)}-{max(a, default=None)})"
            )
        compared += [(s, b[s], a[s]) for s in common]
    if not before:
        empty.append("every pod (no pod)")
    error = (
        f"no step's loss logged both before the failure and after the restore by {', '.join(empty)}: nothing compared"
        if empty
        else None
    )
    return LossComparison(compared, [(s, b, a) for s, b, a in compared if b != a], error)


def restore_seconds(agent: NodeAgentProcess) -> float:
    """Sum of the agent's ``mtc_restore_seconds`` over every source (seconds)."""
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "mtc_restore_seconds"
        for s in family.samples
        if s.name == "mtc_restore_seconds_sum"
    )


def fail_and_restore(cluster: LocalCluster, job: TrainerJob, shape: str, lose_node: bool) -> Restore:
    """SIGKILLs the trainers once each logged a loss past the newest commit (and loses node 1 when
    ``lose_node``), recreates the pods, checks the restore."""
    newest, before = job.kill_past_newest_commit()

    def status() -> dict:
        return cluster.coordinator.status(job.job)["jobs"][0]

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
    job.wait(lambda: all(job.losses(p) for p in job.pods), job.wait_timeout, "the first step after the restore")
    seconds = time.monotonic() - republished
    job.train_past(max(max(b) for b in before) + 1)
    after = [job.losses(p) for p in job.pods]
    agent_seconds = max(restore_seconds(a) - b for a, b in zip(job.agents, agent_before))
    return judge(
        shape,
        "node loss" if lose_node else "preemption",
        newest,
        [job.restore_log(p) for p in job.pods],
        before,
        after,
        seconds,
        agent_seconds,
        status()["restore"]["sources"],
    )


def judge(
    shape: str,
    failure: str,
    newest: int,
    logged_steps: list[int | None | str],
    before: list[dict[int, float]],
    after: list[dict[int, float]],
    seconds: float,
    agent_seconds: float,
    sources: dict[str, str],
) -> Restore:
    """The oracle of one failure: ``before`` and ``after`` are each pod's losses (step -> loss) of
    the killed run and of the restored one; prints what differs or could not be compared."""
    comparison = compare_losses(before, after)
    if comparison.differing:
        print(f"   losses differ (step, before, after): {comparison.differing[:5]}", flush=True)
    if comparison.harness_error:
        print(f"   HARNESS ERROR: {comparison.harness_error}", flush=True)
    return Restore(
        shape,
        failure,
        newest,
        logged_steps,
        [min(a, default=None) for a in after],
        comparison.steps,
        not comparison.differing,
        seconds,
        agent_seconds,
        sources,
        comparison.harness_error,
    )


def preempt_then_lose_a_node(
    cluster: LocalCluster, nodes: int, job: TrainerJob, shape: str, first: int, targets: tuple[int, int], trainer: str
) -> list[Restore]:
    """Starts ``cluster`` with ``nodes`` nodes and ``job``'s pods on them, checks that the first run started fresh (the
    trainers logged the s0 marker by step ``first``), then fails it twice: a preemption once past step
    ``targets[0]``, a node loss once past ``targets[1]``. Returns each ``Restore``, printed as it
    comes; the job and the cluster are stopped in the end, whatever happens.

    Raises:
      RuntimeError: the first run did not start fresh (``trainer`` names who logged what).
    """
    try:
        job.agents = list(cluster.start(nodes).agents)
        job.create_pods()
        job.start_training()
        job.train_past(first)
        fresh = [job.restore_log(p) for p in job.pods]
        if fresh != [None] * len(job.pods):
            raise RuntimeError(f"the first run should start fresh (s0 marker), {trainer} logged {fresh}")
        results = []
        for lose_node, target in zip((False, True), targets):
            job.train_past(target)
            result = fail_and_restore(cluster, job, shape, lose_node)
            print(f"   {result.describe()}", flush=True)
            results.append(result)
        return results
    finally:
        job.kill_training()
        cluster.stop()
