"""A real kubelet (containerd, runc) runs a pod to completion, and the API server reads its log back from that
kubelet: the node the CSI driver will be called from."""

import asyncio

from lightkube import AsyncClient, KubeConfig
from lightkube.models.core_v1 import Container, EnvVar, EnvVarSource, ObjectFieldSelector, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from tests.helpers.kube.node import BUSYBOX_IMAGE

WAIT_SECONDS = 90.0


async def wait_for_phase(client: AsyncClient, name: str, phases: set[str]) -> Pod:
    async def watch() -> Pod:
        async for _, pod in client.watch(Pod, namespace="default", fields={"metadata.name": name}):
            if pod.status and pod.status.phase in phases:
                return pod
        raise AssertionError("the watch ended")

    try:
        return await asyncio.wait_for(watch(), WAIT_SECONDS)
    except TimeoutError:
        pod = await client.get(Pod, name, namespace="default")
        raise AssertionError(f"pod {name} not in {phases} after {WAIT_SECONDS} s: {pod.status}") from None


async def test_busybox_pod_runs_to_completion_on_real_kubelet_and_its_log_reads_back(control_plane, kubelet_node):
    client = AsyncClient(KubeConfig.from_file(control_plane.kubeconfig), field_manager="mtc-tests")
    name = "hello-kubelet"
    pod = Pod(
        metadata=ObjectMeta(name=name, namespace="default"),
        spec=PodSpec(
            nodeSelector={"kubernetes.io/hostname": kubelet_node.name},
            hostNetwork=True,
            restartPolicy="Never",
            containers=[
                Container(
                    name="hello",
                    image=BUSYBOX_IMAGE,
                    imagePullPolicy="Never",
                    command=["sh", "-c", "echo hello from $POD_NODE; ls /var/run/secrets/kubernetes.io/serviceaccount"],
                    env=[EnvVar("POD_NODE", valueFrom=EnvVarSource(fieldRef=ObjectFieldSelector("spec.nodeName")))],
                )
            ],
        ),
    )
    try:
        await client.create(pod)
        done = await wait_for_phase(client, name, {"Succeeded", "Failed"})
        assert done.status.phase == "Succeeded", done.status
        assert done.spec.nodeName == kubelet_node.name
        [state] = done.status.containerStatuses
        assert state.state.terminated.exitCode == 0
        lines = [line.rstrip("\n") async for line in client.log(name, namespace="default")]
        assert lines[0] == f"hello from {kubelet_node.name}"
        assert {"ca.crt", "namespace", "token"} <= set(lines[1:])
    finally:
        await client.delete(Pod, name, namespace="default", grace_period=0)
        await client.close()
