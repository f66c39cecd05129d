"""Elastic restores from RAM end to end (issue 50, item 3): a torchrun job of 2 nodes x 2 local ranks (FSDP2 over
gloo) saves through ``mtc_torch`` on real node agents and a coordinator, then comes back on another node count and
restores its newest step resharded: the coordinator plans the old nodes' copies each new node needs, the agents stage
them from the ramdisks (own or peer) under ``.mtc-resharded-<S>/node-<n>-of-2/``, and the job's ``StepReader`` loads
them into the new world size. Every parameter and optimizer tensor, gathered to full, must equal the saved state bit
for bit, the log must name each copy's source, and the backup tier must not be read."""

import os
import re

import numpy as np
import pytest

from examples.local_cluster import unmount_all_below
from examples.torchrun_job import TORCH_PYTHON, TorchrunJob
from tests.helpers.jobs import (
    UNTIL_KILLED,
    by_event,
    kill_past_newest_commit,
    losses,
    recreate,
    run_job,
    status_of,
    wait_safe_is_newest,
)
from tests.helpers.polling import wait_until

pytestmark = pytest.mark.skipif(
    not os.path.exists(TORCH_PYTHON), reason=f"no torch virtualenv at {TORCH_PYTHON} (make torch-setup)"
)

NODES, LOCAL_RANKS = 2, 2
# A save every ~3 s: above the 2 s push interval, so every step of every rank is replicated (docs/tiers.md).
SLOW = [*UNTIL_KILLED, "--step-sleep", "1.0"]


def full_state(dump_dir, step: int, world: int) -> dict[str, np.ndarray]:
    """Every rank's dump of ``step`` gathered to full: FSDP2 shards dim 0 with ``torch.chunk``, so the local shards in
    global-rank order concatenate to the whole tensor; a value every rank holds whole (a 0-d tensor, a
    hyperparameter) must be equal on all."""
    dumps = [np.load(os.path.join(dump_dir, f"rank{rank}-step{step}.npz")) for rank in range(world)]
    full = {}
    for key in dumps[0].files:
        parts = [d[key] for d in dumps]
        if parts[0].ndim == 0:
            assert all(np.array_equal(p, parts[0]) for p in parts), f"{key} differs between ranks"
            full[key] = parts[0]
        else:
            full[key] = np.concatenate(parts, axis=0)
    return full


def assert_same_full_state(saved: dict[str, np.ndarray], restored: dict[str, np.ndarray]) -> None:
    assert saved and sorted(saved) == sorted(restored)
    assert any(k.startswith("optim/state/") for k in saved), f"no optimizer state compared: {sorted(saved)}"
    for key, value in saved.items():
        assert value.dtype == restored[key].dtype and value.shape == restored[key].shape, key
        assert value.tobytes() == restored[key].tobytes(), f"{key} differs after the elastic restore"


def save_then_stop(start_cluster, tmp_path, name: str):
    """A 2 x 2 job on 2 nodes with a backup tier, killed once every rank's newest step is replicated: returns the
    cluster, the job and that step (every node's ramdisk holds its own copy and the other's replica)."""
    cluster = start_cluster(nodes=NODES, backup=f"file://{tmp_path / 'object-store'}")
    job = run_job(
        name,
        list(cluster.agents),
        tmp_path / name,
        [*SLOW, "--dump-dir", str(tmp_path / "dump-1")],
        job_class=TorchrunJob,
        slices=1,
        nproc_per_node=LOCAL_RANKS,
    )
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 6, 240, "step 6 safe"
    )
    kill_past_newest_commit(job, timeout=120)
    wait_safe_is_newest(cluster, job, 60, "replicas caught up")
    return cluster, job, status_of(cluster, job)["safe_step"]


def resume_reshaped(cluster, job, tmp_path, agents, step: int) -> dict[str, str]:
    """Recreates the job on ``agents`` (a new node count), waits until it trained 2 steps past ``step``, checks
    every node restored ``step`` with the saved full state, the staged copies, and that no backup was read.
    Returns the coordinator's restore sources (rank -> each old node's copy's ``tier:holder``)."""
    recreate(job, tmp_path / "dump-2", agents)
    job.wait(lambda: max(losses(job.pods), default=0) >= step + 2, 300, f"step {step + 2} after the elastic restore")
    assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [step] * len(agents)
    world = len(agents) * LOCAL_RANKS
    assert by_event(job.pods[0], "init")[0]["world"] == world
    assert_same_full_state(
        full_state(tmp_path / "dump-1", step, NODES * LOCAL_RANKS), full_state(tmp_path / "dump-2", step, world)
    )
    sources = status_of(cluster, job)["restore"]["sources"]
    assert len(sources) == len(agents)
    for used in sources.values():
        # Every new node staged both old nodes' copies (a 2-node step), each from a ramdisk: never the backup tier.
        parts = dict(part.split("=") for part in used.split(","))
        assert sorted(parts) == ["node-0-of-2", "node-1-of-2"], used
        assert all(source.split(":")[0] in ("local", "peer_close", "peer_distant") for source in parts.values()), used
    for agent in agents:
        log = open(agent.log_path).read()
        assert f"staged step {step} from backup" not in log, f"{agent.node_id} read the backup tier"
        staged = re.findall(
            rf"staged step {step} from (\S+) (\S+) \(data of rank (\d), files \[([^]]*)\] as (\S+)\)", log
        )
        assert sorted(s[4] for s in staged) == ["node-0-of-2", "node-1-of-2"], f"{agent.node_id}: {staged}"
        assert all(".metadata" in s[3] for s in staged)
    # The new shape trains in a timeline of its own from the resharded step; the old shape's steps go only once a
    # step of the new shape is safe, with the staged copies.
    assert status_of(cluster, job)["rollbacks"] == [step]
    job.wait(lambda: (status_of(cluster, job)["safe_step"] or 0) > step, 120, "a step of the new shape safe")
    wait_until(
        lambda: not any(n.startswith(".mtc-resharded-") for p in job.pods for n in os.listdir(p.target)),
        60,
        "the staged copies removed",
    )
    live = {agent.node_id for agent in agents}  # a lost node's copies stay listed until its grace period ends
    wait_until(
        lambda: (
            not any(live.intersection(held.get(str(step), ())) for held in status_of(cluster, job)["held"].values())
        ),
        60,
        f"the old shape's step {step} collected",
    )
    return sources


def test_a_node_lost_with_no_spare_the_job_restores_on_one_node_from_ram_resharded(start_cluster, tmp_path):
    cluster, job, step = save_then_stop(start_cluster, tmp_path, "shrink")
    lost = job.agents[1]
    cluster.lose_node(lost)
    unmount_all_below(os.path.dirname(job.pods[1].target))
    survivor = job.agents[0]
    sources = resume_reshaped(cluster, job, tmp_path, [survivor], step)
    # Old node 0's copy is the survivor's own step, old node 1's the replica it held: both from its own ramdisk.
    assert sources["0"] == f"node-0-of-2=local:{survivor.node_id},node-1-of-2=local:{survivor.node_id}"


def test_a_scale_up_to_3_nodes_restores_from_ram_resharded(start_cluster, tmp_path):
    cluster, job, step = save_then_stop(start_cluster, tmp_path, "grow")
    fresh = cluster.add_node(len(cluster.agents), block="b0")
    sources = resume_reshaped(cluster, job, tmp_path, [*job.agents, fresh], step)
    # The new node holds nothing: it takes each old node's copy from a peer's ramdisk.
    assert all(part.split("=")[1].startswith("peer_") for part in sources["2"].split(",")), sources
