"""Helpers for end-to-end tests that run real training jobs on a local cluster."""

import json
import os
import signal
import time

import numpy as np

from examples.local_cluster import LocalJob, unmount_all_below
from tests.helpers.polling import wait_until
from tests.helpers.ports import free_port

TRAIN = ["--steps", "30", "--save-interval-steps", "3", "--backup-interval-steps", "6"]
# A job that trains until the test kills it, however slow or fast the machine.
UNTIL_KILLED_STEPS = 100_000
UNTIL_KILLED = ["--steps", str(UNTIL_KILLED_STEPS), "--step-sleep", "0.2"]


# Every job ``run_job`` started: a test that ends (or fails) while its job trains leaves no trainer
# behind; one that trains UNTIL_KILLED would otherwise run on after pytest, taking the machine's CPU.
_started: list[LocalJob] = []


def run_job(name, agents, workdir, extra, job_class=LocalJob, train=TRAIN, **fields):
    """Starts a ``job_class`` job (``LocalJob``: ``examples/train.py``) with ``train`` plus ``extra`` flags on ``agents``."""
    # JAX's coordinator (torchrun's store) binds every address.
    job = job_class(name, agents, str(workdir), [*train, *extra], jax_port=free_port("0.0.0.0"), **fields)
    _started.append(job)
    job.create_pods()
    job.start_training()
    return job


def kill_started_jobs() -> None:
    """SIGKILLs the training processes of every job ``run_job`` started (the fixtures, after each test)."""
    while _started:
        _started.pop().kill_training()


def rerun(job, dump_dir, agents=None, steps=None, timeout=180):
    """Deletes the pods, recreates them (on ``agents`` when the nodes changed), runs the job to the
    end (step ``steps`` if given) with its state dumped to ``dump_dir``."""
    recreate(job, dump_dir, agents, steps)
    job.wait_done(timeout=timeout)


def recreate(job, dump_dir, agents=None, steps=None):
    """Deletes the pods and starts new ones (on ``agents`` when the nodes changed) that train to step
    ``steps`` if given, with their state dumped to ``dump_dir``; returns without waiting."""
    job.delete_pods()
    if agents is not None:
        job.agents[:] = agents
    job.train_args[job.train_args.index("--dump-dir") + 1] = str(dump_dir)
    if steps is not None:
        job.train_args += ["--steps", str(steps)]  # the last --steps wins
    job.create_pods()
    job.start_training()


def replace_node(cluster, job, index, spare=None):
    """Node ``index`` of the job is lost with its ramdisk (and its dead pod's mount); a fresh node joins
    the same topology block (``spare``: one already up there). Returns the job's agents with the fresh
    node in place; the pods are not recreated."""
    cluster.lose_node(job.agents[index])
    if job.pods:
        unmount_all_below(os.path.dirname(job.pods[index].target))  # the dead pod's mount went with the node
    agents = list(job.agents)
    agents[index] = spare or cluster.add_node(len(cluster.agents), block=f"b{index // 2}")
    return agents


def by_event(pod, event):
    return [e for e in pod.events() if e["event"] == event]


def losses(pods):
    return {e["step"]: e["loss"] for pod in pods for e in by_event(pod, "step")}


def committed(job) -> list[set[int]]:
    """The steps each pod of ``job`` has committed (bare integer directories in its local dir)."""
    return [
        {int(n) for n in os.listdir(p.target) if n.isdigit()} if os.path.isdir(p.target) else set() for p in job.pods
    ]


def kill_past_newest_commit(job, timeout=60.0, past=1):
    """SIGKILLs ``job``'s trainers once every pod's newest commit is the same step and rank 0 has
    logged the loss of the step ``past`` steps after it (NeMo's commit of step S holds S + 1, so it
    resumes at S + 2), so the restored run's first losses have the killed run's to be compared with
    (and no rank holds a newer step that its replication would take first). The
    trainers are SIGSTOPped while that is read (no commit or loss lands between the check and the
    kill), and resumed if it does not hold yet. Returns the killed run's losses.

    Raises:
      TimeoutError: not reached within ``timeout`` seconds (the trainers are left running).
    """
    deadline = time.monotonic() + timeout
    while True:
        job.signal_training(signal.SIGSTOP)
        held, logged = committed(job), losses(job.pods)
        newest = max(set.intersection(*held), default=None) if held else None
        if newest is not None and all(max(h) == newest for h in held) and max(logged, default=-1) >= newest + past:
            job.kill_training()
            return logged
        job.signal_training(signal.SIGCONT)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"harness: no moment within {timeout} s when every pod's newest commit was step {newest} and "
                f"rank 0 had logged a step after it (commits {[max(h, default=None) for h in held]}, "
                f"losses to {max(logged, default=None)})"
            )
        exited = [p for p in job.pods if p.process and p.process.poll() is not None]
        if exited:
            raise RuntimeError(
                f"training process {exited[0].name} exited {exited[0].process.returncode} before the kill"
            )
        time.sleep(0.1)


def compared_losses(before, after):
    """The steps whose loss was logged both before a failure and after the restore, asserted equal;
    an empty comparison fails as a harness error (it proves nothing)."""
    common = sorted(set(before) & set(after))
    assert common, (
        f"harness error: no step logged both before the failure (steps {min(before, default=None)}-"
        f"{max(before, default=None)}) and after the restore ({min(after, default=None)}-"
        f"{max(after, default=None)}): nothing compared"
    )
    assert [after[s] for s in common] == [before[s] for s in common], f"losses of steps {common} differ"
    return common


def assert_same_state(left_npz, right_npz):
    left, right = np.load(left_npz), np.load(right_npz)
    assert left.files, f"{left_npz} holds no arrays: nothing compared"
    assert sorted(left.files) == sorted(right.files)
    for key in left.files:
        np.testing.assert_array_equal(left[key], right[key], err_msg=key)


def newest_complete_step(coordinator, job):
    jobs = coordinator.status(job)["jobs"]
    return jobs[0]["newest_complete_step"] if jobs else None


def status_of(cluster, job):
    """The coordinator's status of ``job``."""
    return cluster.coordinator.status(job.job)["jobs"][0]


def coordinator_recorded(coordinator, holds, timeout: float = 10.0) -> list:
    """Waits until the coordinator's recovery state (``<state dir>/recovery.json``: its jobs, as JSON) ``holds``, and
    returns those jobs: a harness sync before a SIGKILL, for the state dir is written within a tick of a decision,
    not with it.

    Raises:
      TimeoutError: it did not within ``timeout`` seconds.
    """
    path = os.path.join(coordinator.workdir, "state", "recovery.json")
    found: list = []

    def written() -> bool:
        try:
            with open(path, encoding="utf-8") as f:
                jobs = json.load(f)["jobs"]
            if holds(jobs):
                found[:] = jobs
                return True
        except (OSError, ValueError, KeyError, IndexError):
            pass
        return False

    wait_until(written, timeout, f"the coordinator's recovery state in {path}")
    return found


def wait_safe_is_newest(cluster, job, timeout: float, what: str) -> None:
    """Waits up to ``timeout`` seconds until the job's safe step is its newest complete step (``what`` names it)."""
    wait_until(
        lambda: status_of(cluster, job)["safe_step"] == status_of(cluster, job)["newest_complete_step"], timeout, what
    )


def lose_node_and_resume(cluster, job, lost_index, tmp_path, steps):
    """Kills the job, loses node ``lost_index`` with its ramdisk, adds a fresh node, recreates the pods."""
    job.kill_training()
    agents = replace_node(cluster, job, lost_index)
    rerun(job, tmp_path / "dump-2", agents=agents, steps=steps)
    return agents[lost_index]


def assert_resumed_exactly(job, step, before_losses, tmp_path, before_dump="dump-1", after_dump="dump-2"):
    """Every rank of the 4-rank ``job`` restored ``step`` and went on with the losses and state of
    before (``before_dump`` against ``after_dump`` below ``tmp_path``)."""
    assert max(before_losses) < UNTIL_KILLED_STEPS, "the job finished before it was killed"
    assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [step] * 4
    after = losses(job.pods)
    assert min(after) == step + 1
    compared_losses(before_losses, after)  # the first losses after the restore are the killed run's
    for rank in range(4):
        name = f"rank{rank}-step{step}.npz"
        assert_same_state(tmp_path / before_dump / name, tmp_path / after_dump / name)
