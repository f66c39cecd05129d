"""The README's Kubernetes quick start on real kubelets: the agent runs in its container from the chart's DaemonSet
and registers with each node's kubelet, the coordinator runs as a Deployment under its ServiceAccount, and
``helm test`` passes; ``mtc doctor`` finds nothing to fix."""

import sys

from tests.helpers.kube.deployment import CHART_ARCHIVE, RELEASE_NAMESPACE


def test_quick_start_runs_the_agent_in_its_container_on_every_node(deployment):
    assert any(c.startswith(f"helm install mtc {CHART_ARCHIVE} ") for c in deployment.installed), deployment.installed
    pods = deployment.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=node")
    assert sorted(p["spec"]["nodeName"] for p in pods["items"]) == sorted(n.name for n in deployment.nodes)
    for pod in pods["items"]:
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert all(c["ready"] for c in pod["status"]["containerStatuses"]), pod["status"]["containerStatuses"]
    for node in deployment.nodes:
        csinode = deployment.kubectl_json("get", "csinode", node.name)
        assert [d["name"] for d in csinode["spec"]["drivers"] or []] == ["ramdisk.csi.mtc.dev"]


def test_helm_test_passes(deployment):
    done = deployment.sh(f"helm test mtc --namespace {RELEASE_NAMESPACE}", timeout=300)
    assert "Phase:          Succeeded" in done.stdout, done.stdout


def doctor(deployment) -> tuple[int, str]:
    """``mtc doctor`` from this machine with the cluster's kubeconfig: its exit status and its screen."""
    done = deployment.sh(f"{sys.executable} -m replicator.cli doctor", check=False)
    return done.returncode, done.stdout + done.stderr


def test_mtc_doctor_passes_on_the_healthy_cluster(deployment):
    code, screen = doctor(deployment)
    assert code == 0, screen
    for node in deployment.nodes:
        assert f"ok    driver registered on {node.name} " in screen, screen
