"""The API server's shapes laid over node reports (replicator/coordinator/kube/kube_overlay.py), and through the cluster
state: a volume with no attributes gets its job's shape, ranks by JobSet index, and rank 0's pod IP as the JAX
coordinator address; a placed pod waits for its IP; a node speaks only for the pods placed on it."""

import logging

import msgspec

from replicator.coordinator.kube import kube_overlay
from replicator.coordinator.kube.kube_overlay import KubeOverlay
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import JobRef, NodeReport, PodReport
from tests.helpers.kube_objects import EXAMPLE_NODES, NS, example_pods, jobset, replicated_job, shapes_of
from tests.helpers.reports import node_report, pod_report

KEY = JobRef(NS, "llama-train-slice")


def agent_pod(slice_index: int, worker: int, *, nodes_given: bool = False) -> PodReport:
    """The pod as the node agent reports a volume with no attributes: shape 1 x 1, indices from the pod name."""
    uid = f"pod-{KEY.job}-{slice_index}-{worker}"
    return pod_report(KEY, slice_index, worker, uid, nodes=1, suffix="abcde", nodes_given=nodes_given)


def agent_report(node: str, *pods: PodReport, topology: dict | None = None) -> NodeReport:
    return node_report(node, pods, topology=topology)


def example_overlay(pods: list[dict] | None = None) -> KubeOverlay:
    overlay = KubeOverlay()
    overlay.update(
        shapes_of(
            example_pods() if pods is None else pods,
            EXAMPLE_NODES,
            [jobset("llama-train", replicated_job("slice", 2, 2))],
        )
    )
    return overlay


def test_a_placed_pod_takes_the_shape_indices_and_ip_and_its_node_the_labels_domains():
    report = example_overlay().apply(agent_report("n10", agent_pod(1, 0)))
    (pod,) = report.pods
    assert (pod.nodes, pod.slices, pod.slice_index, pod.worker_index, pod.address) == (4, 2, 1, 0, "10.1.1.0")
    assert report.topology == {"zone": "zone-1", "nodepool": "pool-1", "block": "block-0"}


def test_a_placed_pod_waits_for_its_ip_and_without_a_block_label_the_pool_is_the_block():
    pods = [{**p, "status": {"phase": "Pending"}} for p in example_pods()]
    overlay = KubeOverlay()
    overlay.update(
        shapes_of(
            pods,
            [{"metadata": {"name": "n10", "labels": {"cloud.google.com/gke-nodepool": "pool-1"}}}],
            [jobset("llama-train", replicated_job("slice", 2, 2))],
        )
    )
    report = overlay.apply(agent_report("n10", agent_pod(1, 0), agent_pod(1, 1, nodes_given=True)))
    assert report.pods == ()  # both placed, neither has an IP yet: even nodes given in attributes wait
    assert report.topology == {"nodepool": "pool-1", "block": "pool-1"}


def test_an_unplaced_pod_waits_whatever_its_volume_sets(caplog):
    overlay = example_overlay(example_pods()[:1])  # only (0, 0) is placed yet
    waiting, given = agent_pod(0, 1), agent_pod(1, 1, nodes_given=True)
    caplog.set_level(logging.INFO, logger=kube_overlay.__name__)
    for _ in range(3):
        assert overlay.apply(agent_report("n01", waiting, given)).pods == ()
    assert caplog.text.count("waits for its place") == 2  # each pod logged once


def test_a_node_speaks_only_for_pods_the_api_server_places_on_it(caplog):
    """n10 lists its own pod, n11's pod (whose uid it learnt) and a fresh uid of the job with its own shape: only its
    own is taken, with the API server's namespace, job, name and shape whatever the node said of them."""
    own = msgspec.structs.replace(
        agent_pod(1, 0), namespace="victims", job="their-job", pod_name="their-job-0-0-x", nodes=1, slices=1
    )
    theirs = agent_pod(1, 1)
    fresh = pod_report(KEY, 0, 0, "pod-never-made", nodes=1)
    caplog.set_level(logging.INFO, logger=kube_overlay.__name__)
    report = example_overlay().apply(agent_report("n10", own, theirs, fresh))
    (pod,) = report.pods
    assert (pod.pod_uid, pod.namespace, pod.job, pod.pod_name) == (
        own.pod_uid,
        NS,
        KEY.job,
        "llama-train-slice-1-0-abcde",
    )
    assert (pod.nodes, pod.slices, pod.slice_index, pod.worker_index) == (4, 2, 1, 0)
    assert (
        "node n10 lists pod llama-train-slice-1-1-abcde (uid pod-llama-train-slice-1-1) that the API server places on node n11: ignored"
        in caplog.text
    )


def test_a_fresh_uid_with_its_own_shape_neither_ends_the_incarnation_nor_takes_a_rank():
    """The attack of issue 48: n10, running rank 2, lists a fresh uid of the job with ``nodes: 1`` beside its own
    pod. Without the placement check the new uid ended the incarnation and a one-rank incarnation put rank 0 on
    n10."""
    overlay, state = example_overlay(), ClusterState(15.0, 60.0)
    for s in range(2):
        for w in range(2):
            state.apply_report(overlay.apply(agent_report(f"n{s}{w}", agent_pod(s, w))), 0.0)
    incarnation = state.job(KEY).incarnation
    assert incarnation is not None
    before = (dict(incarnation.node_of_rank), dict(incarnation.rank_of_pod))
    own = msgspec.structs.replace(agent_pod(1, 0), incarnation=incarnation.incarnation_id, rank=2)
    fresh = pod_report(KEY, 0, 0, "pod-fresh", nodes=1)
    reply = state.apply_report(overlay.apply(agent_report("n10", own, fresh)), 1.0)
    state.tick(1.0)
    assert state.job(KEY).incarnation is incarnation
    assert (incarnation.node_of_rank, incarnation.rank_of_pod) == before
    assert [(a.pod_uid, a.rank) for a in reply.assignments] == [(own.pod_uid, 2)]


def test_the_agents_own_block_overrides_the_node_labels():
    report = example_overlay().apply(agent_report("n10", agent_pod(1, 0), topology={"block": "rack-7"}))
    assert report.topology == {"block": "rack-7"}


def test_update_names_the_jobs_whose_shape_changed():
    overlay = example_overlay(example_pods()[:3])
    js = [jobset("llama-train", replicated_job("slice", 2, 2))]
    assert overlay.update(shapes_of(example_pods(), EXAMPLE_NODES, js)) == {KEY}
    assert overlay.update(shapes_of(example_pods(), EXAMPLE_NODES, js)) == set()
    assert overlay.update(shapes_of([], EXAMPLE_NODES, [])) == {KEY}


def test_attribute_less_volumes_form_an_incarnation_with_jobset_ranks_and_rank0_ip():
    overlay, state = example_overlay(), ClusterState(15.0, 60.0)
    replies = [
        state.apply_report(overlay.apply(agent_report(f"n{s}{w}", agent_pod(s, w))), 0.0)
        for s in range(2)
        for w in range(2)
    ]
    assert [len(r.assignments) for r in replies] == [0, 0, 0, 1]
    incarnation = state.job(KEY).incarnation
    assert {uid: rank for uid, rank in incarnation.rank_of_pod.items()} == {
        f"pod-llama-train-slice-{s}-{w}": 2 * s + w for s in range(2) for w in range(2)
    }
    assert replies[-1].assignments[0].jax_coordinator == "10.1.0.0:8476"


def test_an_unchanged_report_is_returned_as_is_so_heartbeats_stay_cheap():
    overlay = example_overlay()
    report = overlay.apply(agent_report("n10", agent_pod(1, 0), topology={"block": "b"}))
    assert overlay.apply(msgspec.structs.replace(report)) == report
    assert overlay.apply(report) is report
