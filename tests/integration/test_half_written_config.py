"""The Resiliency library writes ``replicator.yaml`` in place (``open``, then ``yaml.dump``): a real agent never
refuses it half-written, and refuses one that stays empty past the bound with a message naming the file and
the wait. The job's side is the NeMo client's (``tests/helpers/nemo_client.py``), run against a real agent
and coordinator."""

import threading
import time

from csi_driver import kubelet
from replicator.local_tier.job_meta import JobMeta
from replicator.pacing.timing import CONFIG_SETTLE_SECONDS
from tests.helpers import nemo_client
from tests.helpers.polling import wait_until


def start_pods(agent, tmp_path, jobs: list[str]) -> list:
    """Publishes a one-node ``pytorch.distributed`` pod of each job and waits until the agent has given each
    its rank, so that it reads ``replicator.yaml`` on every pass from then on. Returns their targets."""
    targets = []
    for job in jobs:
        target = tmp_path / "pods" / job / "mount"
        kubelet.publish(
            agent.endpoint,
            str(target),
            f"{job}-slice-0-0-a",
            pod_uid=f"uid-{job}",
            attributes={"nodes": "1", "size": "8Mi", "framework": "pytorch.distributed"},
        )
        targets.append(target)
    wait_until(
        lambda: all(JobMeta(agent.ramdisk(f"{job}-slice")).progress(f"uid-{job}").jax_init_written for job in jobs),
        30,
        "ranks given",
    )
    return targets


def config(job: str) -> dict:
    return {
        "job-name": job,
        "framework": "pytorch.distributed",
        "node-rank": 0,
        "nodes": 1,
        "peers-per-node": 1,
        "backup-interval-minutes": 30,
    }


def test_a_writer_stalled_between_creating_and_filling_the_file_starts_10_of_10_times(start_cluster, tmp_path):
    agent = start_cluster(nodes=1, peer_tier=False).agents[0]
    jobs = [f"stall{i}" for i in range(10)]
    targets = start_pods(agent, tmp_path, jobs)
    started: dict[str, object] = {}

    def start(job, target):
        try:
            nemo_client.write_config(
                target, config(job), stall=0.2
            )  # empty for 0.2 s: the agent's pass every 0.2 s reads it so
            started[job] = nemo_client.take_restore(target, timeout=60)
        except Exception as err:  # the job failed to start; the test reports it
            started[job] = err

    threads = [threading.Thread(target=start, args=pair) for pair in zip(jobs, targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert started == {job: None for job in jobs}  # all 10 took their fresh-start marker
    assert " ERROR " not in open(agent.log_path).read()


def test_a_file_left_empty_past_the_bound_is_refused_naming_the_file_and_the_wait(start_cluster, tmp_path):
    agent = start_cluster(nodes=1, peer_tier=False).agents[0]
    (target,) = start_pods(agent, tmp_path, ["empty"])
    (target / nemo_client.CONFIG).touch()
    left = time.monotonic()
    try:
        nemo_client.take_restore(target, timeout=30)
        raise AssertionError("the job started with an empty replicator.yaml")
    except nemo_client.ReplicatorFailed as failed:
        message = str(failed)
    assert time.monotonic() - left >= CONFIG_SETTLE_SECONDS
    assert message == (
        f"replicator.yaml field (document): the file is empty (unchanged for {CONFIG_SETTLE_SECONDS:g} s, so not a file still "
        "being written)\n"
    )
    assert (
        "rejected replicator.yaml: replicator.yaml field (document): the file is empty" in open(agent.log_path).read()
    )
