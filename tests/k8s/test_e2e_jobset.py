"""The README's example JobSet, with a driver-only volume (no attributes), applied to a real API server: the real
JobSet controller creates its pods, the coordinator (``--kube``) takes their shape, ranks, rank 0's pod IP and the
nodes' racks from the API server, and a real Orbax job trains on them through a 30 s API-server outage (the
coordinator's link to it cut), a preemption (the JobSet restarts every Job, so the coordinator must read the API
server again) and a node loss (the Node and its ramdisk gone, a fresh Node in the same rack), resuming the newest
step with the same values. The coordinator's Events on the JobSet tell each restore: its source tier and seconds.

The pods run on stand-in nodes (``tests/helpers/kube/jobset_job.py``: a real kubelet here runs only busybox images);
``test_kubelet_csi.py`` covers a real kubelet calling the driver."""

import re
import time

import pytest
from lightkube import codecs
from lightkube.models.core_v1 import NamespaceSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node

from examples.local_cluster import LocalCluster, unmount_all_below
from replicator.coordinator.kube.jobset_annotations import SAFE_STEP
from replicator.coordinator.kube.kube_events import COMPONENT
from replicator.coordinator.kube.kube_shape import DEFAULT_BLOCK_LABEL, ZONE_LABEL
from replicator.coordinator.kube.kube_watch import JobSet
from tests.helpers.jobs import (
    UNTIL_KILLED,
    assert_resumed_exactly,
    kill_past_newest_commit,
    kill_started_jobs,
    losses,
    recreate,
    run_job,
    status_of,
    wait_safe_is_newest,
)
from tests.helpers.kube import register_node
from tests.helpers.kube.jobset_job import JobSetJob
from tests.helpers.kube.link import CuttableLink
from tests.helpers.kube.workloads import example_jobset
from tests.helpers.ports import listen_address

NAMESPACE = "train"
OUTAGE_SECONDS = 30.0
JOBSET = "llama-train"


def rack(node: str) -> str:
    """Nodes 0-1 and 4 (node 1's replacement) are in rack-0, nodes 2-3 in rack-1."""
    return "rack-1" if node in ("node-2", "node-3") else "rack-0"


def add_node(client, name: str) -> None:
    register_node(client, name, labels={ZONE_LABEL: "zone-a", DEFAULT_BLOCK_LABEL: rack(name)})


def driver_only_jobset() -> dict:
    """The README's example JobSet with the managed product's style of volume: the driver, no attributes."""
    document = example_jobset()
    document["metadata"]["namespace"] = NAMESPACE
    for replicated in document["spec"]["replicatedJobs"]:
        for volume in replicated["template"]["spec"]["template"]["spec"]["volumes"]:
            volume["csi"].pop("volumeAttributes", None)
    return document


def restore_events(client, step: int) -> list[tuple[str, str]]:
    """(reason, message) of the coordinator's restore events of ``step`` on the JobSet, oldest first."""
    fields = {"involvedObject.kind": "JobSet", "involvedObject.name": JOBSET, "source": COMPONENT}
    events = sorted(
        client.list(Event, namespace=NAMESPACE, fields=fields), key=lambda e: (e.firstTimestamp, e.metadata.name)
    )
    return [(e.reason, e.message) for e in events if f"step {step} " in e.message]


def annotated_safe_step(client) -> int | None:
    """The JobSet's ``mtc.dev/safe-step`` annotation (``kubectl get jobset`` shows it), or None."""
    annotations = client.get(JobSet, JOBSET, namespace=NAMESPACE).metadata.annotations or {}
    return int(annotations[SAFE_STEP]) if SAFE_STEP in annotations else None


def wait_restore_done(job, client, step: int) -> list[tuple[str, str]]:
    """The restore events of ``step`` once its ``RestoreDone`` is there."""
    job.wait(lambda: "RestoreDone" in dict(restore_events(client, step)), 30, f"RestoreDone of step {step}")
    return restore_events(client, step)


@pytest.fixture
def kube_cluster(own_control_plane, tmp_path):
    """A control plane of the test's own, 4 Nodes, 4 node agents, and a coordinator --kube that reaches the API
    server through a link the test can cut."""
    client = own_control_plane.client()
    client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE), spec=NamespaceSpec()))
    for index in range(4):
        add_node(client, f"node-{index}")
    with CuttableLink(own_control_plane.url.removeprefix("https://")) as link:
        kubeconfig = link.kubeconfig(own_control_plane.kubeconfig, tmp_path / "coordinator.kubeconfig")
        cluster = LocalCluster(str(tmp_path / "cluster"), listen_address, kubeconfig=str(kubeconfig))
        try:
            yield client, cluster.start(4), link
        finally:
            kill_started_jobs()
            cluster.stop()
            unmount_all_below(str(tmp_path))  # the pods' targets, if the test ended before unpublishing them


def test_example_jobset_resumes_through_an_api_outage_preemption_and_node_loss(kube_cluster, tmp_path):
    client, cluster, link = kube_cluster
    jobset = codecs.from_dict(driver_only_jobset())  # a JobSet: kube_watch registered the kind with lightkube
    assert isinstance(jobset, JobSet)
    client.create(jobset)
    job = run_job(
        JOBSET,
        list(cluster.agents),
        tmp_path / "job",
        [*UNTIL_KILLED, "--dump-dir", str(tmp_path / "dump-1")],
        job_class=JobSetJob,
        client=client,
        namespace=NAMESPACE,
    )
    assert job.job == "llama-train-slice"

    # Shape and ranks from the API server: 4 nodes in 2 slices, rank = slice x 2 + worker, rank 0 at its pod IP.
    job.wait(
        lambda: (s := status_of(cluster, job))["safe_step"] is not None and s["safe_step"] >= 6,
        180,
        "identity at step 6",
    )
    status = status_of(cluster, job)
    node_of_rank = {place["rank"]: place["node"] for place in status["ranks"]}
    assert node_of_rank == {index: pod.spec.nodeName for index, pod in enumerate(job.api_pods)}
    job.wait(lambda: (annotated_safe_step(client) or -1) >= 6, 30, "the JobSet's safe-step annotation")
    first_safe = annotated_safe_step(client)
    assert status["identical_peers"] == [[0, 2], [1, 3], [2, 0], [3, 1]]
    # The stand-in wrote each pod's IP (its node's loopback host) to the API server; no agent passes --pod-address.
    rank0_host = next(a for a in cluster.agents if a.node_id == node_of_rank[0]).listen.rpartition(":")[0]
    for pod in job.pods:
        with open(f"{pod.target}/jax-init-info.txt", encoding="utf-8") as info:
            assert info.read().splitlines()[1] == f"{rank0_host}:8476"

    # The API server out of the coordinator's reach for 30 s during training ends nothing: the last shapes stand.
    # (A link cut, not a stopped kube-apiserver: a restarted one keeps the controllers catching up for minutes here;
    # test_kube_watch.py stops the real one under the watcher alone.)
    incarnation, trained = status["incarnation"], max(losses(job.pods))
    link.cut()
    try:
        time.sleep(OUTAGE_SECONDS)
        assert status_of(cluster, job)["incarnation"] == incarnation
        assert max(losses(job.pods)) > trained and all(p.process.poll() is None for p in job.pods)
    finally:
        link.restore()

    # Preemption: every pod deleted; the JobSet restarts its Jobs and the new pods resume the newest step.
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 30, "identity of the last step")
    step = status_of(cluster, job)["newest_complete_step"]
    # `kubectl get jobset` shows the safe step advancing (written at most every 5 s).
    job.wait(lambda: annotated_safe_step(client) == step, 30, f"the JobSet's safe-step annotation at {step}")
    assert step > first_safe
    recreate(job, tmp_path / "dump-2")
    assert job.attempt == 1
    job.wait(lambda: max(losses(job.pods), default=-1) >= max(before), 180, "the preempted run's steps trained again")
    assert_resumed_exactly(job, step, before, tmp_path)
    events = wait_restore_done(job, client, step)
    assert [reason for reason, _ in events] == ["RestoreStarted", "RestoreDone"], events  # every rank from its own
    assert re.fullmatch(rf"restore of step {step} for 4 ranks, .+, from local x4", events[0][1]), events
    assert re.fullmatch(rf"step {step} restored by 4 ranks in \d+\.\d s from local x4", events[1][1]), events

    # Node loss: node-1 and its ramdisk are gone; node-4 joins rack-0. The lost rank restores from its data-parallel peer.
    before = kill_past_newest_commit(job)
    wait_safe_is_newest(cluster, job, 30, "identity of the last step")
    step = status_of(cluster, job)["newest_complete_step"]
    node_of_rank = {place["rank"]: place["node"] for place in status_of(cluster, job)["ranks"]}
    lost_rank = next(rank for rank, node in node_of_rank.items() if node == "node-1")
    peer_node = node_of_rank[(lost_rank + 2) % 4]
    lost = next(a for a in cluster.agents if a.node_id == "node-1")
    cluster.lose_node(lost)
    for pod in job.pods:
        if pod.node is lost:
            unmount_all_below(pod.target)  # the dead pod's mount went with the node
    client.delete(Node, "node-1")
    add_node(client, "node-4")
    cluster.add_node(4)
    recreate(job, tmp_path / "dump-3", agents=[a for a in cluster.agents if a is not lost])
    assert job.attempt == 2 and "node-4" in {pod.spec.nodeName for pod in job.api_pods}
    job.wait(lambda: max(losses(job.pods), default=-1) >= max(before), 180, "the lost node's steps trained again")
    assert_resumed_exactly(job, step, before, tmp_path, before_dump="dump-2", after_dump="dump-3")
    status = status_of(cluster, job)
    assert status["restore"]["step"] == step
    assert {place["rank"]: place["node"] for place in status["ranks"]}[lost_rank] == "node-4"
    # The racks come from the Node labels: the peer is close when it shares rack-0 with node-4.
    distance = "close" if rack(peer_node) == rack("node-4") else "distant"
    assert status["restore"]["sources"][str(lost_rank)] == f"peer_{distance}:{peer_node}", status["restore"]
    events = wait_restore_done(job, client, step)
    assert (events[0][0], events[-1][0]) == ("RestoreStarted", "RestoreDone"), events  # a replan may fall between
    assert re.fullmatch(
        rf"step {step} restored by 4 ranks in \d+\.\d s from local x3, peer_{distance} x1", events[-1][1]
    ), events
