"""``mtc doctor``'s cluster checks against a real API server: a node whose driver registration is missing, a
training namespace without its label, and a node whose pods' memory requests leave no room for ramdisks are each
named with their fix; set right, they pass."""

import pytest
from lightkube.models.core_v1 import (
    Container,
    CSIVolumeSource,
    NamespaceSpec,
    PodSpec,
    ResourceRequirements,
    Volume,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod

from replicator.cli import main
from replicator.cli.doctor_checks import CSINode
from tests.helpers.kube import register_node
from tests.helpers.kube.workloads import NO_PULL_IMAGE

DRIVER = "ramdisk.csi.mtc.dev"
NAMESPACE = "doctor-training"


def _doctor(control_plane, capsys) -> tuple[int, list[str]]:
    code = main(["doctor", "--kubeconfig", str(control_plane.kubeconfig)])
    return code, capsys.readouterr().out.splitlines()


def _line(lines: list[str], check: str) -> tuple[str, str]:
    """(the line of ``check``, the line after it: its fix when it failed)."""
    index = next(i for i, line in enumerate(lines) if line[6:].startswith(check + " "))
    return lines[index], lines[index + 1]


@pytest.fixture
def cluster(control_plane):
    """Two Nodes (one with 8Gi), the ``doctor-training`` namespace; all removed after."""
    client = control_plane.client()
    register_node(client, "doctor-a")
    register_node(client, "doctor-b", memory="8Gi")
    client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE), spec=NamespaceSpec()))
    yield client
    client.delete(Namespace, NAMESPACE)
    registered = {c["metadata"]["name"] for c in client.list(CSINode)}
    for name in ("doctor-a", "doctor-b"):
        client.delete(Node, name)
        if name in registered:
            client.delete(CSINode, name)


def test_doctor_names_the_unregistered_node_the_unlabelled_namespace_and_the_full_node(control_plane, cluster, capsys):
    client = cluster
    client.create(CSINode(metadata={"name": "doctor-a"}, spec={"drivers": [_driver("doctor-a")]}))
    client.create(CSINode(metadata={"name": "doctor-b"}, spec={"drivers": []}))  # the kubelet's, before registration
    trainer = Pod(
        metadata=ObjectMeta(name="trainer", namespace=NAMESPACE),
        spec=PodSpec(
            nodeName="doctor-b",
            containers=[
                Container(name="c", image=NO_PULL_IMAGE, resources=ResourceRequirements(requests={"memory": "7.5Gi"}))
            ],
            volumes=[Volume(name="ckpt", csi=CSIVolumeSource(driver=DRIVER))],
        ),
    )
    client.create(trainer)

    code, lines = _doctor(control_plane, capsys)
    assert code == 1
    assert _line(lines, "driver registered on doctor-a")[0].startswith("ok    ")
    failed, fix = _line(lines, "driver registered on doctor-b")
    assert failed.startswith("FAIL  ") and failed.endswith(f"CSINode doctor-b does not list {DRIVER}")
    assert "--field-selector spec.nodeName=doctor-b" in fix
    failed, fix = _line(lines, f"namespace {NAMESPACE}")
    assert (
        failed.startswith("FAIL  ")
        and fix.strip() == f"fix: kubectl label namespace {NAMESPACE} mtc.dev/checkpointing=enabled"
    )
    failed, _ = _line(lines, "memory for ramdisks on doctor-b")
    assert failed.startswith("FAIL  ") and "0.5 GiB free of 8.0 GiB allocatable (pods request 7.5 GiB)" in failed
    assert _line(lines, "memory for ramdisks on doctor-a")[0].startswith("ok    ")

    # Fixed: registered, labelled, and the pod gone from the full node.
    client.patch(CSINode, "doctor-b", {"spec": {"drivers": [_driver("doctor-b")]}})
    client.patch(Namespace, NAMESPACE, {"metadata": {"labels": {"mtc.dev/checkpointing": "enabled"}}})
    client.delete(Pod, "trainer", namespace=NAMESPACE, grace_period=0)
    _, lines = _doctor(control_plane, capsys)
    assert _line(lines, "driver registered on doctor-b")[0].startswith("ok    ")
    assert _line(lines, "memory for ramdisks on doctor-b")[0].startswith("ok    ")


def _driver(node: str) -> dict:
    return {"name": DRIVER, "nodeID": node}
