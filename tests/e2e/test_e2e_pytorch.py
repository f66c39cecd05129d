"""A real PyTorch job end to end: torchrun with 2 local ranks per node, FSDP2 over gloo, saving through
``mtc_torch`` (the ``pytorch.distributed`` files), through a preemption, a node loss and a cluster loss.
After each failure every rank must resume at the newest complete step with bit-identical model and
optimizer state and the losses the killed run logged."""

import json
import os

import pytest

from examples.torchrun_job import TORCH_PYTHON, TorchrunJob
from tests.helpers import network
from tests.helpers.jobs import (
    UNTIL_KILLED,
    UNTIL_KILLED_STEPS,
    assert_same_state,
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
from tests.helpers.tools import requires_root

pytestmark = pytest.mark.skipif(
    not os.path.exists(TORCH_PYTHON), reason=f"no torch virtualenv at {TORCH_PYTHON} (make torch-setup)"
)

NODES, LOCAL_RANKS = 2, 2
# A save every ~3 s: above the 2 s push interval, so every step of every rank is replicated (docs/tiers.md).
SLOW = [*UNTIL_KILLED, "--step-sleep", "1.0"]


def resume(job, tmp_path, dump: str, step: int, before: dict[int, float], timeout: float = 180) -> None:
    """Recreates the pods (dumping to ``dump``), waits until they trained 2 steps past ``step``, and
    checks every node restored ``step`` and went on with the killed run's losses and state."""
    recreate(job, tmp_path / dump)
    job.wait(lambda: max(losses(job.pods), default=0) >= step + 2, timeout, f"step {step + 2} after the restore")
    assert max(before) < UNTIL_KILLED_STEPS, "the job finished before it was killed"
    assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [step] * NODES
    after = losses(job.pods)
    assert min(after) == step + 1
    compared_losses(before, after)
    previous = sorted(tmp_path.glob(f"dump-*/rank*-step{step}.npz"))
    for rank in range(NODES * LOCAL_RANKS):
        name = f"rank{rank}-step{step}.npz"
        saved = [p for p in previous if p.name == name and p.parent.name != dump]
        assert saved, f"no dump of {name} from before the failure"
        assert_same_state(saved[0], tmp_path / dump / name)


def newest_everywhere(job) -> int:
    return max(set.intersection(*committed(job)))


def test_torchrun_job_resumes_exactly_after_preemption_node_loss_and_cluster_loss(start_cluster, tmp_path):
    cluster = start_cluster(nodes=NODES, backup=f"file://{tmp_path / 'object-store'}")
    job = run_job(
        "tr",
        list(cluster.agents),
        tmp_path / "tr",
        [*SLOW, "--dump-dir", str(tmp_path / "dump-1")],
        job_class=TorchrunJob,
        slices=1,
        nproc_per_node=LOCAL_RANKS,
    )

    # 1. Preemption: every process of every pod SIGKILLed; each node restores its own step.
    job.wait(
        lambda: min((max(c, default=0) for c in committed(job)), default=0) >= 6, 180, "step 6 committed on every node"
    )
    before = kill_past_newest_commit(job, timeout=120)
    step = newest_everywhere(job)
    resume(job, tmp_path, "dump-2", step, before)
    assert set(status_of(cluster, job)["restore"]["sources"].values()) == {f"local:{a.node_id}" for a in job.agents}

    # 2. Node loss: node 1 dies with its ramdisk; its rank restores from the replica on node 0.
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] > step,
        180,
        f"a replicated step after {step}",
    )
    before = kill_past_newest_commit(job, timeout=120)
    wait_safe_is_newest(cluster, job, 60, "replicas caught up")
    step = status_of(cluster, job)["safe_step"]
    job.agents[:] = replace_node(cluster, job, 1)
    resume(job, tmp_path, "dump-3", step, before)
    assert status_of(cluster, job)["restore"]["sources"]["1"] == f"peer_close:{cluster.agents[0].node_id}"

    # 3. Cluster loss: every node and the coordinator go; fresh nodes restore from the backup tier.
    job.wait(lambda: max(status_of(cluster, job)["backups"] or [0]) > step, 180, f"a backup after step {step}")
    before = kill_past_newest_commit(job, timeout=120)
    wait_until(lambda: status_of(cluster, job)["backup_pending"] is None, 60, "backups settled")
    step = max(status_of(cluster, job)["backups"])
    for agent in list(job.agents):
        cluster.lose_node(agent)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    job.agents[:] = [cluster.add_node(len(cluster.agents) + i, block="b0") for i in range(NODES)]
    resume(job, tmp_path, "dump-4", step, before, timeout=240)
    assert set(source.split(":")[0] for source in status_of(cluster, job)["restore"]["sources"].values()) == {"backup"}


def test_hsdp_job_restores_a_lost_node_from_its_identical_replica_without_copies(start_cluster, tmp_path):
    cluster = start_cluster(nodes=NODES)
    # HSDP: 2 replica groups (one per node) sharded over the 2 local ranks; local rank r of both nodes
    # holds the same shards, and mtc_torch's deterministic .metadata makes both nodes' steps sign equal.
    job = run_job(
        "hs",
        list(cluster.agents),
        tmp_path / "hs",
        [*UNTIL_KILLED, "--data-parallelism", "2", "--dump-dir", str(tmp_path / "dump-1")],
        job_class=TorchrunJob,
        slices=2,
        nproc_per_node=LOCAL_RANKS,
    )
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 6,
        180,
        "identity established at step 6",
    )
    status = status_of(cluster, job)
    assert status["identical_peers"] == [[0, 1], [1, 0]]
    # Deduplicated: no node holds the other's data.
    assert all(holders == [f"node-{rank}"] for rank, steps in status["held"].items() for holders in steps.values())
    before = kill_past_newest_commit(job, timeout=120)
    wait_safe_is_newest(cluster, job, 30, "identity of the last step")
    step = status_of(cluster, job)["safe_step"]

    job.agents[:] = replace_node(cluster, job, 1)
    resume(job, tmp_path, "dump-2", step, before)
    assert status_of(cluster, job)["restore"]["sources"]["1"] == "peer_close:node-0"  # node 0 holds rank 1's data


@requires_root
def test_hsdp_job_without_copies_completes_a_backup_cut_by_a_node_loss_and_restores_it_after_a_cluster_loss(
    start_cluster, fake_gcs, tmp_path
):
    """Issue 49: node 1 is lost while a backup uploads. No node holds a replica of rank 1 (data parallelism 2, no
    copies), but node 0 holds rank 0's step in rank 1's checksums (HSDP: local rank r of both nodes holds the same
    shards), so it writes rank 1's manifest naming its own objects and the backup commits. A cluster loss then
    restores that backup, in the bytes the ranks wrote."""
    cluster = start_cluster(nodes=NODES, backup="gs://ckpt/mtc", env={"STORAGE_EMULATOR_HOST": fake_gcs.url})
    train = ["--data-parallelism", "2", "--backup-interval-steps", "12", "--hidden", "1024"]
    job = run_job(
        "dpb",
        list(cluster.agents),
        tmp_path / "dpb",
        [*UNTIL_KILLED, *train, "--dump-dir", str(tmp_path / "dump-1")],
        job_class=TorchrunJob,
        slices=2,
        nproc_per_node=LOCAL_RANKS,
    )
    job.wait(lambda: status_of(cluster, job)["backups"], 180, "a first backup")
    first = max(status_of(cluster, job)["backups"])
    bucket = fake_gcs.client().bucket("ckpt")
    steps = f"mtc/default/{job.job}/steps"

    # The store slowed to 4 Mbit/s (a node's 12.4 MiB take about 26 s): node 1 is lost before rank 1 is stored.
    with network.rate_limited([network.Endpoint("127.0.0.1", fake_gcs.port)], rate_mbit=4):
        wait_until(lambda: (status_of(cluster, job)["backup_pending"] or 0) > first, 120, "the next backup chosen")
        pending = status_of(cluster, job)["backup_pending"]
        wait_until(lambda: status_of(cluster, job)["safe_step"] > pending, 60, f"a step newer than {pending} safe")
        before = kill_past_newest_commit(job, timeout=60)
        wait_safe_is_newest(cluster, job, 30, "identity of the newest step")
        safe = status_of(cluster, job)["safe_step"]
        job.agents[:] = replace_node(cluster, job, 1)
        assert not bucket.blob(f"{steps}/{pending}/rank-1.manifest.json").exists()  # cut: rank 1 was not stored
    resume(job, tmp_path, "dump-2", safe, before)  # rank 1 restores from node 0's identical copy
    job.kill_training()

    wait_until(lambda: bucket.blob(f"{steps}/{pending}/COMMIT").exists(), 60, f"the cut backup of {pending} committed")
    stood_in = json.loads(bucket.blob(f"{steps}/{pending}/rank-1.manifest.json").download_as_text())
    own = json.loads(bucket.blob(f"{steps}/{pending}/rank-0.manifest.json").download_as_text())
    assert stood_in["files"] == own["files"] and {f["object"].split("/")[0] for f in own["files"].values()} == {
        "rank-0"
    }
    committed_steps = {
        int(b.name.split("/")[-2]) for b in bucket.list_blobs(prefix=f"{steps}/") if b.name.endswith("/COMMIT")
    }
    assert max(committed_steps) == pending, committed_steps

    # Cluster loss: every node and the coordinator go; fresh nodes restore the cut backup.
    for agent in list(job.agents):
        cluster.lose_node(agent)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    job.agents[:] = [cluster.add_node(len(cluster.agents) + i, block="b0") for i in range(NODES)]
    resume(job, tmp_path, "dump-3", pending, before, timeout=240)  # the state dumped at step pending, bit for bit
    assert status_of(cluster, job)["restore"]["sources"] == {"0": "backup:backup", "1": "backup:backup"}
