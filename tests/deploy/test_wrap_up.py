"""The rest of the chart's promises, after the job's life (``test_training.py``): the coordinator's RBAC is exactly
what it used, the values schema refuses a wrong ``kubeletDir`` on a live release, ``mtc doctor`` names a node whose
driver registration is removed, and docs/install.md's uninstall,
run word for word, leaves no mount, socket or registration behind on the nodes."""

import json
import re

from tests.deploy.test_install import doctor
from tests.helpers import REPO
from tests.helpers.kube.deploy_node import KUBELET_DIR
from tests.helpers.kube.deployment import RELEASE_NAMESPACE, TRAINING_NAMESPACE
from tests.helpers.polling import wait_until

DRIVER = "ramdisk.csi.mtc.dev"
COORDINATOR = f"system:serviceaccount:{RELEASE_NAMESPACE}:mtc-coordinator"
AGENT = f"system:serviceaccount:{RELEASE_NAMESPACE}:mtc"


def granted(deployment) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every rule of the chart's ClusterRole for the coordinator."""
    role = deployment.kubectl_json("get", "clusterrole", "mtc-coordinator")
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule.get("apiGroups", [""])
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def requests_of(deployment, user: str) -> list[dict]:
    events = [json.loads(line) for line in deployment.plane.audit_log.read_text().splitlines() if line.strip()]
    return [e for e in events if e["user"]["username"] == user]


def test_the_coordinators_rbac_is_exactly_what_it_uses(deployment):
    requests = requests_of(deployment, COORDINATOR)
    assert requests, "the coordinator made no request to the API server"
    refused = {(e["verb"], e["requestURI"]) for e in requests if e.get("responseStatus", {}).get("code") == 403}
    assert not refused, f"the coordinator was refused (a verb missing from its ClusterRole): {refused}"
    used = {
        (e["objectRef"].get("apiGroup", ""), e["objectRef"]["resource"], e["verb"])
        for e in requests
        if e.get("objectRef")
    }
    # A patch of an event bumps the count of one repeated within 10 minutes (kube_events.py): the deployed job's
    # restores may not repeat one, so that verb alone may go unused.
    repeats_only = {("", "events", "patch")}
    unused = granted(deployment) - used
    assert used <= granted(deployment) and unused <= repeats_only, f"granted but unused: {unused}; used: {used}"
    # The agents hold no API token (automountServiceAccountToken: false) and never call the API server.
    assert not requests_of(deployment, AGENT)


def test_the_schema_refuses_a_wrong_kubelet_dir_on_a_live_release(deployment):
    revision = deployment.kubectl_json("get", "secrets", "-n", RELEASE_NAMESPACE, "-l", "owner=helm")["items"]
    done = deployment.sh(
        f"helm upgrade mtc charts/mtc --namespace {RELEASE_NAMESPACE} --reuse-values --set-json kubeletDir=5",
        check=False,
    )
    assert done.returncode != 0 and "kubeletDir" in done.stderr, done.stderr
    after = deployment.kubectl_json("get", "secrets", "-n", RELEASE_NAMESPACE, "-l", "owner=helm")["items"]
    assert len(after) == len(revision), "a refused upgrade made a release revision"


def test_mtc_doctor_names_the_node_whose_registration_is_removed(deployment):
    broken, healthy = deployment.nodes[0], deployment.nodes[1]
    # What the kubelet does when the plugin unregisters: the driver gone from the node's CSINode.
    deployment.sh(
        f'kubectl patch csinode {broken.name} --type json -p \'[{{"op": "replace", "path": "/spec/drivers", "value": []}}]\''
    )
    code, screen = doctor(deployment)
    assert code == 1, screen
    failed = rf"^FAIL  driver registered on {broken.name} +CSINode {broken.name} does not list {DRIVER}$"
    assert re.search(failed, screen, re.MULTILINE), screen
    assert f"--field-selector spec.nodeName={broken.name}" in screen, screen
    assert f"ok    driver registered on {healthy.name} " in screen, screen


def uninstall_commands() -> str:
    """docs/install.md's uninstall block, as its reader runs it."""
    text = (REPO / "docs" / "install.md").read_text(encoding="utf-8").split("## Uninstall", 1)[1]
    return text.split("```sh\n", 1)[1].split("```", 1)[0]


def test_uninstall_as_documented_leaves_nothing_on_the_nodes(deployment):
    # "First stop the training jobs that use the driver" (test_training.py's job is deleted with its module).
    wait_until(lambda: not deployment.kubectl_json("get", "pods", "-n", TRAINING_NAMESPACE)["items"], 120, "no pods")
    deployment.sh(uninstall_commands(), timeout=300)
    wait_until(
        lambda: not deployment.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE)["items"],
        120,
        "the chart's pods gone",
    )
    plugin = f"{KUBELET_DIR}/plugins/{DRIVER}"
    for node in deployment.nodes:
        assert not [m for m in node.mounts() if m.startswith(plugin + "/") or m == plugin], node.mounts()
        assert not node.path(f"{plugin}/csi.sock").exists(), f"{node.name}: the CSI socket stayed"
        assert not node.path(f"{KUBELET_DIR}/plugins_registry/{DRIVER}-reg.sock").exists(), node.name
        wait_until(
            lambda node=node: not deployment.kubectl_json("get", "csinode", node.name)["spec"].get("drivers"),
            60,
            f"{node.name}'s CSINode without the driver",
        )
    assert DRIVER not in deployment.sh("kubectl get csidrivers -o name").stdout
