"""A NeMo job through Google's Resiliency library, end to end: 2 nodes x 2 ranks writing the library's files in
its order (``tests/helpers/nemo_client.py``: its ``replicator.yaml`` written in place, async saves under
``step=<G>/`` committed by the rename to ``<G-1>``), through a preemption and a node loss. Its saves are no
error anywhere, the commits of G-1 replicate, and each restore gives every rank its exact bytes back."""

import dataclasses
import sys

from examples.local_cluster import LocalJob, Pod
from tests.helpers import REPO
from tests.helpers.agents import scrape
from tests.helpers.jobs import (
    UNTIL_KILLED_STEPS,
    by_event,
    committed,
    compared_losses,
    kill_past_newest_commit,
    losses,
    recreate,
    replace_node,
    run_job,
    status_of,
    wait_safe_is_newest,
)
from tests.helpers.polling import wait_until

NEMO_CLIENT = str(REPO / "tests" / "helpers" / "nemo_client.py")
NODES, LOCAL_RANKS, EVERY = 2, 2, 3
# A save every 3 s: above the 2 s push interval, so every commit of every rank is replicated (docs/tiers.md).
# The yaml writer stalls 0.2 s, the finalize waits 0.3 s after the mark went: the agent's 0.2 s passes see both.
FLAGS = [
    "--steps",
    str(UNTIL_KILLED_STEPS),
    "--save-interval-steps",
    str(EVERY),
    "--step-sleep",
    "1.0",
    "--local-ranks",
    str(LOCAL_RANKS),
    "--yaml-stall",
    "0.2",
    "--finalize-pause",
    "0.3",
]


@dataclasses.dataclass
class NemoJob(LocalJob):
    """``LocalJob`` whose pod ``i`` runs the NeMo client as node rank ``i`` (the library's ``NODE_RANK``)."""

    framework: str = "pytorch.distributed"

    def train_command(self, pod: Pod) -> list[str]:
        return [
            sys.executable,
            NEMO_CLIENT,
            "--local-dir",
            pod.target,
            "--job-name",
            self.name,
            "--node-rank",
            str(self.pods.index(pod)),
            "--nodes",
            str(len(self.agents)),
            *self.train_args,
        ]


def quiet(cluster, job) -> None:
    """Nothing says error: no agent's log line, no refused step, no message to the job."""
    for agent in job.agents:
        assert " ERROR " not in open(agent.log_path).read(), agent.tail_log()
        assert "mtc_refused_steps_total 0.0" in scrape(agent.url)
    assert [e for pod in job.pods for e in by_event(pod, "replicator_error")] == []


def resume(job, tmp_path, dump: str, step: int, before: dict[int, float]) -> None:
    """Recreates the pods (dumping to ``dump``), waits until they trained past the restore, and checks that every
    node adopted ``step``, loaded global step ``step + 1`` (NeMo's commit G-1 holds G) bit for bit, and went on
    with the killed run's losses."""
    recreate(job, tmp_path / dump)
    job.wait(lambda: max(losses(job.pods), default=0) >= step + 4, 180, f"global step {step + 4} after the restore")
    assert max(before) < UNTIL_KILLED_STEPS, "the job finished before it was killed"
    assert [(e["step"], e["global_step"]) for p in job.pods for e in by_event(p, "restored")] == [
        (step, step + 1)
    ] * NODES
    after = losses(job.pods)
    assert min(after) == step + 2
    compared_losses(before, after)
    for rank in range(NODES * LOCAL_RANKS):
        name = f"rank{rank}-step{step + 1}.bin"
        saved = [p for p in tmp_path.glob(f"dump-*/{name}") if p.parent.name != dump]
        assert saved, f"no dump of {name} from before the failure"
        assert (tmp_path / dump / name).read_bytes() == saved[0].read_bytes()


def test_nemo_saves_are_no_error_commit_g_minus_1_replicated_and_restore_exactly(start_cluster, tmp_path):
    cluster = start_cluster(nodes=NODES)
    job = run_job(
        "nm",
        list(cluster.agents),
        tmp_path / "nm",
        [*FLAGS, "--dump-dir", str(tmp_path / "dump-1")],
        job_class=NemoJob,
        train=[],
        slices=1,
    )

    # Normal saves: each commit is the rename of step=G to G-1, replicated to the other node; nothing is an error.
    job.wait(
        lambda: min((max(c, default=0) for c in committed(job)), default=0) >= 3 * EVERY - 1,
        180,
        "3 saves committed on every node",
    )
    assert all(step % EVERY == EVERY - 1 for steps in committed(job) for step in steps)
    wait_until(lambda: (status_of(cluster, job)["safe_step"] or 0) >= 2 * EVERY - 1, 60, "a commit replicated")
    safe = str(status_of(cluster, job)["safe_step"])
    assert {rank: sorted(steps[safe]) for rank, steps in status_of(cluster, job)["held"].items()} == {
        "0": ["node-0", "node-1"],
        "1": ["node-0", "node-1"],
    }
    quiet(cluster, job)

    # 1. Preemption: every pod SIGKILLed (perhaps mid-save); each node restores its own commit.
    before = kill_past_newest_commit(job, timeout=120, past=2)
    step = max(set.intersection(*committed(job)))
    resume(job, tmp_path, "dump-2", step, before)
    assert set(status_of(cluster, job)["restore"]["sources"].values()) == {f"local:{a.node_id}" for a in job.agents}
    quiet(cluster, job)

    # 2. Node loss: node 1 dies with its ramdisk; its rank restores from the replica on node 0.
    job.wait(lambda: (status_of(cluster, job)["safe_step"] or 0) > step, 180, f"a replicated commit after {step}")
    before = kill_past_newest_commit(job, timeout=120, past=2)
    wait_safe_is_newest(cluster, job, 60, "replicas caught up")
    step = status_of(cluster, job)["safe_step"]
    job.agents[:] = replace_node(cluster, job, 1)
    resume(job, tmp_path, "dump-3", step, before)
    assert status_of(cluster, job)["restore"]["sources"]["1"] == f"peer_close:{cluster.agents[0].node_id}"
