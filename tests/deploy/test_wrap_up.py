"""The rest of the chart's promises, after the job's life (``test_training.py``): the coordinator's RBAC is exactly
what it used, the values schema refuses a wrong ``kubeletDir`` on a live release, ``mtc doctor`` names a node whose
driver registration is removed, agents restarted with a backup store they cannot use say so in a Warning event on
their Node within 30 s of their start, and docs/install.md's uninstall,
run word for word, leaves no mount, socket or registration behind on the nodes."""

import datetime
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


# An s3:// store on a closed port of the agent's own loopback: the connection is refused at once, so the probe fails
# for the store within a second (botocore's 3 attempts), not by its 30 s timeout. boto3 must find credentials for
# the agent to open the store at all (without, it exits at its start): fake keys in the environment.
BAD_STORE, BAD_ENDPOINT = "s3://no-such-bucket/mtc", "http://127.0.0.1:9"
FAKE_KEYS = [{"name": "AWS_ACCESS_KEY_ID", "value": "mtc-deploy"}, {"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}]
STORE_EVENT_SECONDS = 30.0  # issue 52: a bad store is a Warning event within 30 s of the agent's start


def _seconds(timestamp: str) -> float:
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _agents_started(deployment, old: set[str]) -> dict[str, float] | None:
    """Node name -> when the mtc-node container of its agent pod not in ``old`` (UIDs) started (Unix seconds), once
    every node has one running; else None."""
    pods = deployment.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=node")
    started = {
        pod["spec"]["nodeName"]: _seconds(status["state"]["running"]["startedAt"])
        for pod in pods["items"]
        if pod["metadata"]["uid"] not in old
        for status in pod["status"].get("containerStatuses") or []
        if status["name"] == "mtc-node" and "running" in status["state"]
    }
    return started if set(started) == {n.name for n in deployment.nodes} else None


def _store_events(deployment) -> dict[str, dict]:
    """Node name -> its ``BackupStoreUnusable`` event (Node events are in ``default``, as the kubelet's)."""
    events = deployment.kubectl_json(
        "get", "events", "-n", "default", "--field-selector", "reason=BackupStoreUnusable,involvedObject.kind=Node"
    )
    return {e["involvedObject"]["name"]: e for e in events["items"]}


def test_agents_with_a_bad_backup_store_give_a_warning_event_on_their_node_within_30_s(deployment):
    pods = deployment.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=node")
    old = {p["metadata"]["uid"] for p in pods["items"]}
    assert not _store_events(deployment), "a store event before any store was set"
    # Both agents restart at once (maxUnavailable 2): one after the other would double the wait.
    deployment.sh(
        f"helm upgrade mtc charts/mtc --namespace {RELEASE_NAMESPACE} --reuse-values "
        f"--set backup.url={BAD_STORE} --set backup.s3EndpointURL={BAD_ENDPOINT} "
        f"--set-json 'node.env={json.dumps(FAKE_KEYS)}' --set node.updateStrategy.rollingUpdate.maxUnavailable=2"
    )
    wait_until(lambda: _agents_started(deployment, old), 120, "an agent restarted on every node")
    started = _agents_started(deployment, old)
    assert started is not None
    wait_until(
        lambda: set(_store_events(deployment)) == set(started),
        STORE_EVENT_SECONDS + 10,
        lambda: f"a BackupStoreUnusable event on each of {sorted(started)}: {sorted(_store_events(deployment))}",
    )
    for node, event in _store_events(deployment).items():
        assert event["type"] == "Warning", event
        assert event["message"].startswith(f"node {node}: backup store {BAD_STORE} unusable: "), event["message"]
        assert "Could not connect to the endpoint URL" in event["message"], event["message"]
        after = _seconds(event["firstTimestamp"]) - started[node]
        assert 0 <= after <= STORE_EVENT_SECONDS, f"{node}: the event came {after:.0f} s after the agent's start"


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
