"""The kubelet calls our CSI driver: a real ``mtc node`` registers itself in the kubelet's ``plugins_registry``
(``csi_driver/registration.py``, no node-driver-registrar), and the kubelet publishes an inline ephemeral volume of
``ramdisk.csi.mtc.dev`` into a busybox pod, unpublishes it when the pod is deleted, and publishes the same job
ramdisk, data and all, into the pod that replaces it."""

import ast
import asyncio
import re
from pathlib import Path

import pytest
from lightkube import ApiError, AsyncClient, KubeConfig, codecs
from lightkube.generic_resource import create_global_resource
from lightkube.models.core_v1 import Container, CSIVolumeSource, PodSpec, Volume, VolumeMount
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from lightkube.resources.storage_v1 import CSIDriver

from csi_driver import mounts
from examples.local_cluster import NodeAgentProcess, unmount_all_below
from tests.helpers import REPO
from tests.helpers.kube.node import BUSYBOX_IMAGE
from tests.helpers.ports import listen_address

DRIVER = "ramdisk.csi.mtc.dev"
NAMESPACE = "default"
WAIT_SECONDS = 90.0
# A JobSet's names: JobSet "mtc-reg", replicatedJob "slice", job 0, pod 0; the job (the ramdisk's key) derives
# from the pod name as <jobset>-<replicatedJob>, as for pods the JobSet controller makes.
JOBSET, JOB = "mtc-reg", "mtc-reg-slice"
LABELS = {
    "jobset.sigs.k8s.io/jobset-name": JOBSET,
    "jobset.sigs.k8s.io/replicatedjob-name": "slice",
    "jobset.sigs.k8s.io/job-index": "0",
    "batch.kubernetes.io/job-completion-index": "0",
}
# As in manifests/example-jobset.yaml, for a one-node job and a small ramdisk.
ATTRIBUTES = {"nodes": "1", "slices": "1", "size": "16Mi", "jaxCoordinatorPort": "8476"}
GREETING = "written by the first pod"
# Read as a generic resource: the typed model refuses the "drivers": null of a CSINode with no driver
# (lightkube 1.0.1: "Expected `array`, got `null` - at `$.spec.drivers`").
CSINode = create_global_resource("storage.k8s.io", "v1", "CSINode", "csinodes")


def training_pod(name: str, node: str, script: str) -> Pod:
    """A busybox pod shaped like one JobSet worker, with the driver-only style of inline volume plus attributes."""
    return Pod(
        metadata=ObjectMeta(name=name, namespace=NAMESPACE, labels=LABELS, annotations=LABELS),
        spec=PodSpec(
            nodeSelector={"kubernetes.io/hostname": node},
            hostNetwork=True,
            restartPolicy="Never",
            terminationGracePeriodSeconds=1,
            containers=[
                Container(
                    name="worker",
                    image=BUSYBOX_IMAGE,
                    imagePullPolicy="Never",
                    command=["sh", "-c", script],
                    volumeMounts=[VolumeMount(name="mtc-local", mountPath="/local")],
                )
            ],
            volumes=[Volume(name="mtc-local", csi=CSIVolumeSource(driver=DRIVER, volumeAttributes=ATTRIBUTES))],
        ),
    )


async def wait_for(what: str, condition, seconds: float = WAIT_SECONDS):
    """Polls the async ``condition`` until it returns something truthy, which is returned."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not (result := await condition()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not after {seconds} s")
        await asyncio.sleep(0.3)
    return result


async def pod_in_phase(client: AsyncClient, name: str, phases: set[str]) -> Pod:
    async def phase() -> Pod | None:
        pod = await client.get(Pod, name, namespace=NAMESPACE)
        return pod if pod.status and pod.status.phase in phases else None

    return await wait_for(f"pod {name} in {phases}", phase)


async def delete_pod(client: AsyncClient, name: str) -> None:
    """Deletes the pod and returns once the kubelet has removed it, which it does only after unmounting its volumes."""
    try:
        await client.delete(Pod, name, namespace=NAMESPACE)
    except ApiError as error:
        if error.status.code != 404:
            raise

    async def gone() -> bool:
        try:
            await client.get(Pod, name, namespace=NAMESPACE)
        except ApiError as error:
            if error.status.code == 404:
                return True
            raise
        return False

    await wait_for(f"pod {name} removed by the kubelet", gone)


def target_path(kubelet_root: Path, pod: Pod) -> str:
    """Where the kubelet asks an inline CSI volume to be published."""
    return str(kubelet_root / "pods" / pod.metadata.uid / "volumes" / "kubernetes.io~csi" / "mtc-local" / "mount")


def published_contexts(log: str) -> dict[str, dict[str, str]]:
    """The ``volume_context`` of each publish in the agent's log, by target path."""
    found = re.findall(r"published \S+ for pod \S+ at (\S+), volume_context (\{.*\})$", log, re.MULTILINE)
    return {target: ast.literal_eval(context) for target, context in found}


def mounted(path: str) -> bool:
    return any(entry.mount_point == path for entry in mounts.mount_table())


@pytest.fixture
async def kube(control_plane):
    client = AsyncClient(KubeConfig.from_file(control_plane.kubeconfig), field_manager="mtc-tests")
    [driver] = codecs.load_all_yaml((REPO / "manifests" / "csidriver.yaml").read_text())
    await client.create(driver)
    yield client
    await client.delete(CSIDriver, DRIVER)
    await client.close()


@pytest.fixture
async def registered_agent(kubelet_node, kube):
    """A real ``mtc node`` on the kubelet's node, registered with that kubelet through its plugins_registry."""
    agent = NodeAgentProcess(
        kubelet_node.name,
        str(kubelet_node.dir / "mtc-agent"),
        listen_address(),
        "tmpfs",
        ["--kubelet-registration-dir", str(kubelet_node.root_dir / "plugins_registry")],
    )

    async def csinode_driver():
        try:
            node = await kube.get(CSINode, kubelet_node.name)
        except ApiError:
            return None
        return next((d for d in node["spec"].get("drivers") or [] if d["name"] == DRIVER), None)

    try:
        agent.start()
        # Registering, the kubelet calls NodeGetInfo on our CSI socket and writes the node id into its CSINode.
        driver = await wait_for("our driver in the node's CSINode", csinode_driver, 30.0)
        assert driver["nodeID"] == kubelet_node.name
        assert "kubelet registered CSI driver ramdisk.csi.mtc.dev" in Path(agent.log_path).read_text()
        yield agent
    finally:
        agent.stop()
        unmount_all_below(agent.root)

    async def csinode_driver_gone() -> bool:
        return await csinode_driver() is None

    # The registration socket went with the agent, and with it the kubelet's registration.
    await wait_for("our driver gone from the node's CSINode", csinode_driver_gone, 30.0)


async def test_kubelet_publishes_inline_ramdisk_and_a_recreated_pod_finds_the_first_pods_data(
    kubelet_node, kube, registered_agent
):
    agent = registered_agent
    first, second = f"{JOB}-0-0-first", f"{JOB}-0-0-again"
    log_path = Path(agent.log_path)
    try:
        # The first pod writes into the ramdisk and stays up until it is deleted, like a preempted worker.
        await kube.create(
            training_pod(first, kubelet_node.name, f"echo '{GREETING}' > /local/greeting && exec sleep 3600")
        )
        pod = await pod_in_phase(kube, first, {"Running", "Failed", "Succeeded"})
        assert pod.status.phase == "Running", pod.status
        first_target = target_path(kubelet_node.root_dir, pod)
        contexts = published_contexts(log_path.read_text())
        assert first_target in contexts, log_path.read_text()
        assert mounted(first_target)
        ramdisk_file = Path(agent.ramdisk(JOB)) / "client" / "greeting"
        await wait_for("the first pod's file in the job ramdisk", lambda: asyncio.to_thread(ramdisk_file.exists))

        # What the kubelet sends for an inline volume: the attributes plus the pod's identity (podInfoOnMount).
        context = contexts[first_target]
        print(f"volume_context from the kubelet: {context}")
        assert context == {
            **ATTRIBUTES,
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.name": first,
            "csi.storage.k8s.io/pod.namespace": NAMESPACE,
            "csi.storage.k8s.io/pod.uid": pod.metadata.uid,
            "csi.storage.k8s.io/serviceAccount.name": "default",
        }

        await delete_pod(kube, first)
        assert f"unpublished {first_target}" in log_path.read_text()
        assert not mounted(first_target)
        assert ramdisk_file.read_text() == GREETING + "\n"  # the ramdisk outlived the pod

        # Its replacement, same JobSet names, same node: the same job ramdisk, with the first pod's file.
        await kube.create(training_pod(second, kubelet_node.name, "cat /local/greeting"))
        done = await pod_in_phase(kube, second, {"Succeeded", "Failed"})
        assert done.status.phase == "Succeeded", done.status
        assert [line.rstrip("\n") async for line in kube.log(second, namespace=NAMESPACE)] == [GREETING]
        second_context = published_contexts(log_path.read_text())[target_path(kubelet_node.root_dir, done)]
        assert (second_context["csi.storage.k8s.io/pod.name"], second_context["csi.storage.k8s.io/pod.uid"]) == (
            second,
            done.metadata.uid,
        )
    finally:
        for name in (first, second):
            await delete_pod(kube, name)
