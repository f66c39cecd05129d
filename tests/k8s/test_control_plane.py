"""The README's example JobSet against a real control plane: the real JobSet controller and its webhooks, the
Job controller of kube-controller-manager, and kube-scheduler binding to Node objects that have no kubelet.
Everything is read back through lightkube's asyncio client, the library the coordinator will use."""

import asyncio
from collections.abc import Callable

from lightkube import AsyncClient, codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import Pod, Service

from tests.helpers.kube import register_node
from tests.helpers.kube.workloads import example_jobset

JobSet = create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")

NAMESPACE = "default"
WAIT_SECONDS = 60.0


async def watch_until(client: AsyncClient, kind, labels: dict[str, str], done: Callable[[dict], bool]) -> dict:
    """The objects of ``kind`` with ``labels``, by name, once ``done`` holds for them; read from one watch
    (which starts with every existing object), bounded by ``WAIT_SECONDS``."""
    seen: dict = {}

    async def watch() -> dict:
        async for event, obj in client.watch(kind, namespace=NAMESPACE, labels=labels):
            if event == "DELETED":
                seen.pop(obj.metadata.name, None)
            else:
                seen[obj.metadata.name] = obj
            if done(seen):
                return seen
        raise AssertionError("the watch ended")

    try:
        return await asyncio.wait_for(watch(), WAIT_SECONDS)
    except TimeoutError:
        raise AssertionError(
            f"{kind.__name__} {labels}: not there after {WAIT_SECONDS} s; seen: {sorted(seen)}"
        ) from None


async def test_example_jobset_gets_jobs_headless_service_and_annotated_pods_bound_without_kubelet(control_plane, kube):
    plane_client = control_plane.client()
    nodes = [f"fake-node-{i}" for i in range(4)]
    for node in nodes:
        register_node(plane_client, node, labels={"topology.kubernetes.io/zone": f"zone-{int(node[-1]) // 2}"})
    jobset = codecs.from_dict(example_jobset())
    name = jobset.metadata.name
    await kube.create(jobset, namespace=NAMESPACE)
    selector = {"jobset.sigs.k8s.io/jobset-name": name}
    try:
        jobs = await watch_until(kube, Job, selector, lambda seen: len(seen) == 2)
        assert sorted(jobs) == [f"{name}-slice-0", f"{name}-slice-1"]
        assert {job.spec.completionMode for job in jobs.values()} == {"Indexed"}

        service = await kube.get(Service, name, namespace=NAMESPACE)
        assert service.spec.clusterIP == "None"
        assert service.spec.selector == selector

        pods = await watch_until(
            kube, Pod, selector, lambda seen: len(seen) == 4 and all(p.spec.nodeName for p in seen.values())
        )
        placement = {}
        for pod in pods.values():
            annotations = pod.metadata.annotations
            job_index = annotations["jobset.sigs.k8s.io/job-index"]
            pod_index = annotations["batch.kubernetes.io/job-completion-index"]
            assert annotations["jobset.sigs.k8s.io/jobset-name"] == name
            assert annotations["jobset.sigs.k8s.io/replicatedjob-name"] == "slice"
            # The DNS name mtc must write for rank 0: <hostname>.<subdomain>, the subdomain being the JobSet's name.
            assert pod.spec.hostname == f"{name}-slice-{job_index}-{pod_index}"
            assert pod.spec.subdomain == name
            assert pod.metadata.name.startswith(pod.spec.hostname + "-")
            assert [v.csi.driver for v in pod.spec.volumes if v.csi] == ["ramdisk.csi.mtc.dev"]
            # Bound by the scheduler with no kubelet anywhere; nothing runs them, so they stay Pending.
            assert pod.status.phase == "Pending"
            assert any(c.type == "PodScheduled" and c.status == "True" for c in pod.status.conditions)
            placement[(job_index, pod_index)] = pod.spec.nodeName
        assert sorted(placement) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
        # The example's anti-affinity: one training pod per node.
        assert sorted(placement.values()) == nodes
    finally:
        await kube.delete(JobSet, name, namespace=NAMESPACE)
