"""The coordinator's Events (replicator/coordinator/kube/kube_events.py) against a real API server, sent with the
coordinator's own identity (``manifests/coordinator-rbac.yaml``): created on a Pod, a repeat counted by a patch,
similar ones combined and a flood cut by the spam filter, as client-go's recorder does; and a node's notices
(replicator/coordinator/kube/node_notices.py) on the pod the shapes place on that node, and on the Node."""

import asyncio
import contextlib

import pytest
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.models.core_v1 import Container, NamespaceSpec, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding

from replicator.coordinator.kube.kube_events import (
    BURST,
    COMBINED_PREFIX,
    COMPONENT,
    SIMILAR_MAX,
    EventRecorder,
    EventType,
    ObjectRef,
)
from replicator.coordinator.kube.kube_shape import FailureDomains, JobShape, PodPlace, Shapes
from replicator.coordinator.kube.node_notices import NoticeEvents
from replicator.wire.messages import JobRef, NodeReport, Notice
from tests.helpers.kube.workloads import NO_PULL_IMAGE
from tests.k8s.test_kube_watch import COORDINATOR_NAMESPACE, coordinator_kubeconfig, eventually

NAMESPACE = "events"


@pytest.fixture
async def recorder(control_plane, kube, tmp_path):
    """An ``EventRecorder`` running with the coordinator's identity, and the ``events`` namespace; both removed
    after."""
    await kube.create(Namespace(metadata=ObjectMeta(name=NAMESPACE), spec=NamespaceSpec()))
    kubeconfig = await asyncio.to_thread(coordinator_kubeconfig, control_plane, tmp_path / "coordinator.kubeconfig")
    client = AsyncClient(KubeConfig.from_file(kubeconfig), field_manager="mtc-coordinator")
    recorder = EventRecorder(client, host="coordinator-0")
    task = asyncio.create_task(recorder.run())
    try:
        yield recorder
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
        await kube.delete(Namespace, NAMESPACE)
        with contextlib.suppress(ApiError):
            await kube.delete(Namespace, COORDINATOR_NAMESPACE)
            for kind in (ClusterRole, ClusterRoleBinding):
                await kube.delete(kind, "mtc-coordinator")
        # Namespaces go once the namespace controller emptied them: the next test creates them again.
        await eventually(lambda: _gone(kube, NAMESPACE), f"namespace {NAMESPACE} deleted")
        await eventually(lambda: _gone(kube, COORDINATOR_NAMESPACE), f"namespace {COORDINATOR_NAMESPACE} deleted")


async def _gone(kube: AsyncClient, namespace: str) -> bool:
    try:
        await kube.get(Namespace, namespace)
        return False
    except ApiError as error:
        return error.status.code == 404


async def _pod(kube: AsyncClient, name: str) -> ObjectRef:
    pod = Pod(
        metadata=ObjectMeta(name=name, namespace=NAMESPACE),
        # No scheduler picks it: bound to a node (the kubelet tests' leave Nodes behind), its deletion would wait
        # for a kubelet that is gone, and the namespace's with it.
        spec=PodSpec(containers=[Container(name="c", image=NO_PULL_IMAGE)], schedulerName="mtc-tests-unscheduled"),
    )
    created = await kube.create(pod)
    return ObjectRef("Pod", "v1", NAMESPACE, name, created.metadata.uid)


async def _events_of(kube: AsyncClient, name: str) -> list[Event]:
    """The coordinator's events about object ``name`` (not the scheduler's ``FailedScheduling``), oldest first."""
    events = kube.list(Event, namespace=NAMESPACE, fields={"involvedObject.name": name, "source": COMPONENT})
    return sorted([e async for e in events], key=lambda e: (e.firstTimestamp, e.metadata.name))


async def test_event_on_a_pod_is_created_and_its_repeat_bumps_the_count(kube, recorder):
    pod = await _pod(kube, "trainer-0")
    recorder.record(pod, EventType.NORMAL, "RestoreStarted", "restoring step 40 from local: 1.0 GiB")
    recorder.record(pod, EventType.WARNING, "RestoreFellBack", "rank 0: from local to peer: checksum mismatch")
    recorder.record(pod, EventType.WARNING, "RestoreFellBack", "rank 0: from local to peer: checksum mismatch")
    await recorder.idle()

    events = await _events_of(kube, "trainer-0")
    assert [(e.type, e.reason, e.count) for e in events] == [
        ("Normal", "RestoreStarted", 1),
        ("Warning", "RestoreFellBack", 2),
    ]
    started, fell_back = events
    assert started.message == "restoring step 40 from local: 1.0 GiB"
    assert (started.involvedObject.kind, started.involvedObject.uid) == ("Pod", pod.uid)
    assert (started.source.component, started.source.host) == ("mtc-coordinator", "coordinator-0")
    assert fell_back.lastTimestamp >= fell_back.firstTimestamp


async def test_similar_events_are_combined_and_a_flood_is_cut_at_the_burst(kube, recorder):
    pod = await _pod(kube, "trainer-1")
    for i in range(BURST + 5):
        recorder.record(pod, EventType.WARNING, "RamdiskNearlyFull", f"ramdisk {90 + i % 10}.{i} % full")
    await recorder.idle()

    events = await _events_of(kube, "trainer-1")
    # The first SIMILAR_MAX each an Event; the next one starts the combined Event, which the rest of the burst bumps;
    # the 5 past the burst are dropped.
    assert len(events) == SIMILAR_MAX + 1
    combined = [e for e in events if e.message.startswith(COMBINED_PREFIX)]
    assert len(combined) == 1
    assert combined[0].count == BURST - SIMILAR_MAX
    assert combined[0].message == f"{COMBINED_PREFIX}ramdisk {90 + (BURST - 1) % 10}.{BURST - 1} % full"
    assert sum(e.count for e in events) == BURST


async def test_node_notices_go_to_the_pod_placed_on_that_node_and_to_the_node(kube, recorder):
    pod = await _pod(kube, "trainer-2")
    await kube.create(Node(metadata=ObjectMeta(name="notices-node-a")))
    try:
        key = JobRef(NAMESPACE, "llama")
        place = PodPlace(pod.name, pod.uid, 0, 0, None, None, "notices-node-a", None)
        shapes = Shapes(
            {key: JobShape(key, "llama", "js-uid", ("slice",), 1, 1, 1, (place,))},
            (),
            {"notices-node-a": FailureDomains(None, None, None)},
        )
        full = Notice("RamdiskNearlyFull", "ramdisk too small: 63.9 of 64.0 MiB used", NAMESPACE, pod.uid)
        store = Notice("BackupStoreUnusable", "backup store gs://b/mtc unusable: upload failed: 404")
        notices = NoticeEvents(recorder)
        notices.take(NodeReport("notices-node-a", "https://a", None, {}, (), (), notices=(full, store)), shapes)
        # Another node naming the pod, and a node the API server does not know: nothing.
        notices.take(NodeReport("notices-node-b", "https://b", None, {}, (), (), notices=(full, store)), shapes)
        await recorder.idle()

        (event,) = await _events_of(kube, pod.name)
        assert (event.type, event.reason, event.count) == ("Warning", "RamdiskNearlyFull", 1)
        assert event.message == f"node notices-node-a: {full.message}"
        assert (event.involvedObject.kind, event.involvedObject.uid) == ("Pod", pod.uid)
        on_node = kube.list(Event, namespace="default", fields={"involvedObject.name": "notices-node-a"})
        (node_event,) = [e async for e in on_node]
        assert (node_event.type, node_event.reason) == ("Warning", "BackupStoreUnusable")
        assert (node_event.involvedObject.kind, node_event.involvedObject.uid) == ("Node", "notices-node-a")
        on_b = kube.list(Event, namespace="default", fields={"involvedObject.name": "notices-node-b"})
        assert [e async for e in on_b] == []
    finally:
        await kube.delete(Node, "notices-node-a")
        async for event in kube.list(Event, namespace="default", fields={"involvedObject.name": "notices-node-a"}):
            await kube.delete(Event, event.metadata.name, namespace="default")
