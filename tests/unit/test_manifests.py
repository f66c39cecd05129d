"""The Kubernetes manifests honour the contract in DESIGN.md section 3.

Static checks of the files as written (parsed with PyYAML); test_rendered_manifests.py renders
them with kustomize and helm and validates them against the Kubernetes schemas.
"""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from csi_driver.quantity import parse_quantity
from tests.helpers import REPO

MANIFESTS = REPO / "manifests"
EXAMPLE = "example-jobset.yaml"
TORCH_EXAMPLE = "example-torchrun-jobset.yaml"
EXAMPLES = (EXAMPLE, TORCH_EXAMPLE)
KUSTOMIZATION = "kustomization.yaml"

DRIVER_NAME = "ramdisk.csi.mtc.dev"
PLUGIN_DIR = f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
KUBELET_PODS_DIR = "/var/lib/kubelet/pods"
PLUGINS_REGISTRY = "/var/lib/kubelet/plugins_registry"
# Below the kubelet's root, a shared mount as Bidirectional propagation needs (a host's / may be private).
DATA_ROOT = f"{PLUGIN_DIR}/data"
COORDINATOR_URL = "https://mtc-coordinator.mtc-system.svc:8471"
TLS_DIR = "/etc/mtc/tls"
CLUSTER_SCOPED = (
    "Namespace",
    "CSIDriver",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
)
# What the coordinator reads from the API server (replicator/coordinator/kube/kube_watch.py), and only that.
# (apiGroup, resource, verb): what the coordinator does with the API server, nothing more. Get on pods and nodes
# and create on tokenreviews are per-node identity's (replicator/coordinator/trust/node_identity.py); create on
# tokenreviews and subjectaccessreviews operator identity's (replicator/coordinator/trust/operator_auth.py); create and
# patch on events the restore events' (replicator/coordinator/kube/kube_events.py: a repeat bumps its count); patch on
# jobsets the safe and backed-up steps' annotations (replicator/coordinator/kube/jobset_annotations.py).
COORDINATOR_VERBS = {
    *(
        (group, resource, verb)
        for group, resource in [("", "pods"), ("", "nodes")]
        for verb in ("get", "list", "watch")
    ),
    ("jobset.x-k8s.io", "jobsets", "list"),
    ("jobset.x-k8s.io", "jobsets", "watch"),
    ("jobset.x-k8s.io", "jobsets", "patch"),
    ("authentication.k8s.io", "tokenreviews", "create"),
    ("authorization.k8s.io", "subjectaccessreviews", "create"),
    ("", "events", "create"),
    ("", "events", "patch"),
}
# The operators' roles (manifests/operator-rbac.yaml): the verbs the coordinator asks RBAC about, and nothing else.
OPERATOR_ROLES = {
    "mtc-checkpoint-viewer": {("mtc.dev", "checkpoints", "get")},
    "mtc-rollback": {
        ("mtc.dev", "checkpoints", "get"),
        ("mtc.dev", "rollbacks", "create"),
        ("mtc.dev", "rollbacks", "delete"),
    },
}
BLOCK_LABEL = "cloud.google.com/gce-topology-block"


def _load(name: str) -> list[dict]:
    with open(MANIFESTS / name, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _resource_files() -> list[str]:
    return sorted(p.name for p in MANIFESTS.glob("*.y*ml") if p.name not in (KUSTOMIZATION, *EXAMPLES))


def _all_objects() -> list[dict]:
    return [doc for name in _resource_files() + list(EXAMPLES) for doc in _load(name)]


def _one(kind: str, name: str | None = None) -> dict:
    found = [o for o in _all_objects() if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _container(pod_spec: dict, name: str) -> dict:
    by_name = {c["name"]: c for c in pod_spec.get("containers", [])}
    assert name in by_name, f"no container {name!r}; have {sorted(by_name)}"
    return by_name[name]


def _argv(container: dict) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def _flags(argv: list[str], flag: str) -> list[str]:
    """Values of every ``--flag value`` or ``--flag=value``."""
    values = []
    for i, arg in enumerate(argv):
        if arg == flag:
            assert i + 1 < len(argv), f"{flag} has no value"
            values.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1 :])
    return values


def _flag(argv: list[str], flag: str) -> str:
    """Value of ``--flag``; fails the test if absent or repeated."""
    values = _flags(argv, flag)
    assert len(values) == 1, f"expected {flag} once in {argv}, found {values}"
    return values[0]


def _sidecar_with_image(pod_spec: dict, image_name: str) -> dict:
    found = [c for c in pod_spec["containers"] if c["image"].split(":")[0].endswith("/" + image_name)]
    assert len(found) == 1, f"expected one {image_name} container"
    return found[0]


def _host_path_at(pod_spec: dict, container: dict, mount_path: str) -> tuple[str, dict]:
    """(host path, volumeMount) of the hostPath volume mounted at ``mount_path``."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    assert len(mounts) == 1, f"{container['name']} has no single mount at {mount_path}"
    volume = volumes[mounts[0]["name"]]
    assert "hostPath" in volume, f"volume {volume['name']} is not a hostPath"
    return volume["hostPath"]["path"].rstrip("/"), mounts[0]


@pytest.fixture(scope="module")
def node_pod() -> dict:
    return _one("DaemonSet", "mtc-node")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def node_container(node_pod) -> dict:
    return _container(node_pod, "mtc-node")


def test_every_manifest_parses_into_kubernetes_objects():
    for name in _resource_files() + [*EXAMPLES, KUSTOMIZATION]:
        docs = _load(name)
        assert docs, f"{name} is empty"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), f"{name}: object without apiVersion/kind"
            if name != KUSTOMIZATION:
                assert doc.get("metadata", {}).get("name"), f"{name}: {doc['kind']} without a name"


def _app_version() -> str:
    with open(REPO / "charts" / "mtc" / "Chart.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)["appVersion"]


def test_images_name_the_release_not_latest():
    # The chart's image tag defaults to its appVersion; the base names the same tag in every file and in
    # kustomization.yaml's images: entry (which an overlay's `kustomize edit set image` replaces).
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert _app_version() == version
    (kustomization,) = _load(KUSTOMIZATION)
    assert kustomization["images"] == [{"name": "mtc-agent", "newTag": version}]
    images = [
        c["image"]
        for o in _all_objects()
        if o["kind"] in ("DaemonSet", "Deployment")
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("mtc-agent")
    ]
    assert images == [f"mtc-agent:{version}"] * 2


def test_kustomization_lists_exactly_the_resource_files():
    (kustomization,) = _load(KUSTOMIZATION)
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), f"duplicate resources: {listed}"
    for name in listed:
        assert (MANIFESTS / name).is_file(), f"kustomization lists missing file {name}"
    assert not set(EXAMPLES) & set(listed), "the example JobSets are user workloads, not part of the base"
    assert sorted(listed) == _resource_files()


def test_namespaced_objects_live_in_mtc_system():
    assert _one("Namespace")["metadata"]["name"] == "mtc-system"
    for name in _resource_files():
        for doc in _load(name):
            if doc["kind"] not in CLUSTER_SCOPED:
                assert doc["metadata"].get("namespace") == "mtc-system", f"{doc['kind']} {doc['metadata']['name']}"


def test_csidriver_is_node_only_ephemeral_with_pod_info():
    spec = _one("CSIDriver")["spec"]
    assert _one("CSIDriver")["metadata"]["name"] == DRIVER_NAME
    assert spec["attachRequired"] is False
    assert spec["podInfoOnMount"] is True
    assert spec["volumeLifecycleModes"] == ["Ephemeral"]
    assert spec["fsGroupPolicy"] == "File"


def test_node_agents_get_no_kubernetes_api_access():
    # The agents talk to kubelet and the coordinator only: no role for their account, no mounted API token.
    account = _one("ServiceAccount", "mtc")
    assert account["automountServiceAccountToken"] is False
    pod = _one("DaemonSet", "mtc-node")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mtc"
    assert pod["automountServiceAccountToken"] is False
    bound = [s for o in _all_objects() if o["kind"] in ("RoleBinding", "ClusterRoleBinding") for s in o["subjects"]]
    assert all(s["name"] != "mtc" for s in bound), bound


def _granted(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_coordinator_alone_may_read_pods_nodes_and_jobsets_and_review_tokens_nothing_more():
    kinds = [doc["kind"] for doc in _all_objects()]
    assert "Role" not in kinds and "RoleBinding" not in kinds
    # The operators' roles are bound by the cluster's admins, to their operators (operator-rbac.yaml).
    assert kinds.count("ClusterRole") == 1 + len(OPERATOR_ROLES) and kinds.count("ClusterRoleBinding") == 1
    role = _one("ClusterRole", "mtc-coordinator")
    assert _granted(role) == COORDINATOR_VERBS
    assert not any("resourceNames" in rule or "nonResourceURLs" in rule for rule in role["rules"])
    binding = _one("ClusterRoleBinding", "mtc-coordinator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "mtc-coordinator",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mtc-coordinator", "namespace": "mtc-system"}]
    account = _one("ServiceAccount", "mtc-coordinator")
    assert account["automountServiceAccountToken"] is False  # the pod asks for it
    pod = _one("Deployment", "mtc-coordinator")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mtc-coordinator"
    assert pod["automountServiceAccountToken"] is True


def test_operators_roles_grant_only_what_the_coordinator_asks_and_aggregate_into_view_and_admin():
    for name, verbs in OPERATOR_ROLES.items():
        role = _one("ClusterRole", name)
        assert _granted(role) == verbs, name
        assert not any("resourceNames" in rule or "nonResourceURLs" in rule for rule in role["rules"])
    aggregated = {
        name: {
            k for k, v in _one("ClusterRole", name)["metadata"]["labels"].items() if "aggregate-to" in k and v == "true"
        }
        for name in OPERATOR_ROLES
    }
    assert aggregated == {
        "mtc-checkpoint-viewer": {"rbac.authorization.k8s.io/aggregate-to-view"},
        "mtc-rollback": {"rbac.authorization.k8s.io/aggregate-to-admin"},
    }
    coordinator = _container(_one("Deployment", "mtc-coordinator")["spec"]["template"]["spec"], "mtc-coordinator")
    assert "--operator-identity" in _argv(coordinator) and "--kube" in _argv(coordinator)
    # Their resources' CRDs, for kubectl's discovery: namespaced, and refusing every object.
    resources = {resource for verbs in OPERATOR_ROLES.values() for _, resource, _ in verbs}
    for resource in resources:
        crd = _one("CustomResourceDefinition", f"{resource}.mtc.dev")["spec"]
        assert (crd["group"], crd["scope"], crd["names"]["plural"]) == ("mtc.dev", "Namespaced", resource)
        (version,) = crd["versions"]
        (rule,) = version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
        assert rule["rule"] == "false" and "RBAC only" in rule["message"]


def test_admission_policy_admits_the_driver_only_in_opted_in_namespaces():
    policy = _one("ValidatingAdmissionPolicy", "mtc-ramdisk-namespaces")["spec"]
    (rule,) = policy["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods"] and "CREATE" in rule["operations"]
    assert policy["failurePolicy"] == "Fail"
    (validation,) = policy["validations"]
    assert f"v.csi.driver == '{DRIVER_NAME}'" in validation["expression"]
    binding = _one("ValidatingAdmissionPolicyBinding", "mtc-ramdisk-namespaces")["spec"]
    assert binding["policyName"] == "mtc-ramdisk-namespaces"
    assert binding["validationActions"] == ["Deny"]
    (selector,) = binding["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert selector == {"key": "mtc.dev/checkpointing", "operator": "NotIn", "values": ["enabled"]}


def test_node_plugin_is_privileged_and_critical_on_every_node(node_pod, node_container):
    ds = _one("DaemonSet", "mtc-node")
    assert node_container["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    assert node_container["image"] == f"mtc-agent:{_app_version()}"
    assert node_pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in node_pod["tolerations"], "must tolerate every taint"
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert node_container["resources"]["requests"]["cpu"]
    assert node_container["resources"]["requests"]["memory"]


def test_node_plugin_runs_the_node_agent_with_the_contract_flags(node_container):
    argv = _argv(node_container)
    assert argv[:2] == ["mtc", "node"], argv
    assert _flag(argv, "--node-id") == "$(NODE_NAME)"
    assert _flag(argv, "--root") == DATA_ROOT
    assert _flag(argv, "--listen") == "0.0.0.0:8470"
    assert _flag(argv, "--coordinator") == COORDINATOR_URL
    assert _flag(argv, "--peer-token-file") == "/etc/mtc/peer-token/token"
    assert parse_quantity(_flag(argv, "--default-size")) == 2**30
    assert float(_flag(argv, "--retention-seconds")) == 86400
    assert _flag(argv, "--replicas") == "1"
    # Failure domains come from the Node labels, which the coordinator reads; a --topology here would override them.
    assert _flags(argv, "--topology") == []
    env = {e["name"]: e for e in node_container["env"]}
    assert not {"NODE_ZONE", "NODE_BLOCK"} & set(env), "the pod's own labels carry no node topology"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["MTC_ROOT"]["value"] == DATA_ROOT, "mtc gc's default --root, in `kubectl exec`"
    # Every $(VAR) the args use must be defined, or kubelet passes it through literally.
    for var in re.findall(r"\$\((\w+)\)", " ".join(argv)):
        assert var in env, f"{var} is referenced in args but not defined"


def test_node_agent_checks_the_coordinator_certificate_against_the_cluster_ca(node_pod, node_container):
    ca = Path(_flag(_argv(node_container), "--coordinator-ca"))
    assert ca == Path(TLS_DIR, "ca.crt")
    (mount,) = [m for m in node_container["volumeMounts"] if m["mountPath"] == str(ca.parent)]
    volume = next(v for v in node_pod["volumes"] if v["name"] == mount["name"])
    # Only the CA: the coordinator's private key never reaches the nodes.
    assert volume["secret"] == {"secretName": "mtc-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}


def test_node_plugin_keeps_only_the_host_paths_it_needs(node_pod):
    host_paths = sorted(v["hostPath"]["path"] for v in node_pod["volumes"] if "hostPath" in v)
    assert host_paths == sorted([PLUGIN_DIR, PLUGINS_REGISTRY, KUBELET_PODS_DIR, DATA_ROOT])
    registration = next(
        v["name"] for v in node_pod["volumes"] if v.get("hostPath", {}).get("path", "").endswith("plugins_registry")
    )
    users = [c["name"] for c in node_pod["containers"] if any(m["name"] == registration for m in c["volumeMounts"])]
    assert users == ["mtc-node"]
    assert [c["name"] for c in node_pod["containers"]] == ["mtc-node", "liveness-probe"]
    for sidecar in node_pod["containers"][1:]:
        assert sidecar["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }, sidecar["name"]


def test_node_plugin_driver_name_matches_csidriver(node_container):
    assert _flag(_argv(node_container), "--driver-name") == _one("CSIDriver")["metadata"]["name"]


def test_node_plugin_mounts_kubelet_pods_and_data_root_bidirectionally(node_pod, node_container):
    host, mount = _host_path_at(node_pod, node_container, KUBELET_PODS_DIR)
    assert host == KUBELET_PODS_DIR
    assert mount["mountPropagation"] == "Bidirectional"

    host, mount = _host_path_at(node_pod, node_container, DATA_ROOT)
    assert host == DATA_ROOT
    assert mount["mountPropagation"] == "Bidirectional"
    volume = next(v for v in node_pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"


def test_every_copy_of_the_data_root_follows_the_ramdisks_unmounts(node_pod):
    # A mount of a host directory holding the data root copies the ramdisks mounted there when its container
    # starts; a private copy (no propagation) keeps a released ramdisk's tmpfs, and its RAM, until it exits.
    volumes = {v["name"]: v["hostPath"]["path"].rstrip("/") for v in node_pod["volumes"] if "hostPath" in v}
    copies = [
        (c["name"], m["mountPath"], m.get("mountPropagation", "None"))
        for c in node_pod["containers"]
        for m in c.get("volumeMounts", [])
        if m["name"] in volumes and (DATA_ROOT + "/").startswith(volumes[m["name"]] + "/")
    ]
    assert {(name, path) for name, path, _ in copies} == {
        ("mtc-node", PLUGIN_DIR),
        ("mtc-node", DATA_ROOT),
        ("liveness-probe", "/csi"),
    }
    assert all(propagation in ("HostToContainer", "Bidirectional") for _, _, propagation in copies), copies


def _assert_mounts_token_secret(pod: dict, container: dict, token_file: Path) -> None:
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent)]
    assert len(mounts) == 1
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    assert volume["secret"]["secretName"] == "mtc-peer-token"


def test_node_plugin_mounts_the_peer_token_secret(node_pod, node_container):
    _assert_mounts_token_secret(node_pod, node_container, Path(_flag(_argv(node_container), "--peer-token-file")))


def test_coordinator_requires_the_same_token(node_container):
    pod = _one("Deployment", "mtc-coordinator")["spec"]["template"]["spec"]
    container = _container(pod, "mtc-coordinator")
    argv = _argv(container)
    token_file = _flag(argv, "--token-file")
    assert token_file == _flag(_argv(node_container), "--peer-token-file")
    assert "--insecure" not in argv
    _assert_mounts_token_secret(pod, container, Path(token_file))


def test_coordinator_serves_https_with_the_mtc_tls_certificate():
    pod = _one("Deployment", "mtc-coordinator")["spec"]["template"]["spec"]
    container = _container(pod, "mtc-coordinator")
    argv = _argv(container)
    assert _flag(argv, "--tls-cert") == f"{TLS_DIR}/tls.crt"
    assert _flag(argv, "--tls-key") == f"{TLS_DIR}/tls.key"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR]
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "mtc-tls"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe


def test_agent_registers_with_the_kubelet_itself_and_its_csi_socket_sits_at_the_host_path(node_pod, node_container):
    # csi_driver/registration.py tells the kubelet the agent's own --csi-endpoint path: the kubelet dials it on the host.
    assert "node-driver-registrar" not in {c["name"] for c in node_pod["containers"]}
    argv = _argv(node_container)
    endpoint = _flag(argv, "--csi-endpoint")
    assert endpoint.startswith("unix://"), endpoint
    socket_in_container = Path(endpoint[len("unix://") :])
    host_dir, _ = _host_path_at(node_pod, node_container, str(socket_in_container.parent))
    assert host_dir == PLUGIN_DIR
    assert socket_in_container == Path(PLUGIN_DIR, "csi.sock")

    registration_dir = _flag(argv, "--kubelet-registration-dir")
    host_dir, mount = _host_path_at(node_pod, node_container, registration_dir)
    assert host_dir == PLUGINS_REGISTRY
    assert not mount.get("readOnly"), "the agent creates its registration socket there"


def test_livenessprobe_sidecar_backs_the_plugin_liveness_probe(node_pod, node_container):
    probe = _sidecar_with_image(node_pod, "livenessprobe")
    assert probe["image"] == "registry.k8s.io/sig-storage/livenessprobe:v2.15.0"
    argv = _argv(probe)
    assert _flag(argv, "--csi-address") == "/csi/csi.sock"
    assert _host_path_at(node_pod, probe, "/csi")[0] == PLUGIN_DIR
    health_port = int(_flag(argv, "--health-port"))
    assert health_port == 9808

    http_get = node_container["livenessProbe"]["httpGet"]
    assert http_get["path"] == "/healthz"
    port = http_get["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in node_container["ports"] if p.get("name") == port)
    assert port == health_port


def test_coordinator_is_one_replica_behind_its_service():
    deploy = _one("Deployment", "mtc-coordinator")
    assert deploy["spec"]["replicas"] == 1
    pod = deploy["spec"]["template"]["spec"]
    container = _container(pod, "mtc-coordinator")
    argv = _argv(container)
    assert argv[:2] == ["mtc", "coordinator"], argv
    assert _flag(argv, "--listen") == "0.0.0.0:8471"
    state_dir = _flag(argv, "--state-dir")
    assert state_dir in {m["mountPath"] for m in container["volumeMounts"]}

    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/healthz"
    assert readiness["port"] in (8471, "https")
    assert {"name": "https", "containerPort": 8471, "protocol": "TCP"} in container["ports"]

    service = _one("Service", "mtc-coordinator")
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8471
    assert port["targetPort"] in (8471, "https")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_coordinator_reads_job_shapes_and_node_failure_domains_from_the_api_server():
    pod = _one("Deployment", "mtc-coordinator")["spec"]["template"]["spec"]
    argv = _argv(_container(pod, "mtc-coordinator"))
    assert argv.count("--kube") == 1
    assert _flag(argv, "--block-label") == BLOCK_LABEL
    assert _flag(argv, "--driver-name") == _one("CSIDriver")["metadata"]["name"]
    assert not _flags(argv, "--kube-namespace"), "JobSets in every namespace use the driver"


@pytest.mark.parametrize("name", ["llama-train", "torch-train"])
def test_example_jobset_volume_matches_its_shape(name):
    jobset = _one("JobSet", name)
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    (replicated,) = jobset["spec"]["replicatedJobs"]
    slices = replicated["replicas"]
    job_spec = replicated["template"]["spec"]
    assert job_spec["parallelism"] == job_spec["completions"]
    pod = job_spec["template"]["spec"]

    (volume,) = [v for v in pod["volumes"] if "csi" in v]
    csi = volume["csi"]
    assert csi["driver"] == _one("CSIDriver")["metadata"]["name"]
    attributes = csi["volumeAttributes"]
    assert all(isinstance(v, str) for v in attributes.values()), "volumeAttributes must be strings"
    assert int(attributes["nodes"]) == slices * job_spec["parallelism"]
    assert int(attributes["slices"]) == slices
    parse_quantity(attributes["size"])  # its sizing and the memory limit: test_example_manifests.py

    (container,) = pod["containers"]
    mounts = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert [m["mountPath"] for m in mounts] == ["/local"]


def test_torchrun_example_runs_each_node_at_its_jobset_index_with_the_pytorch_protocol():
    jobset = _one("JobSet", "torch-train")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = _argv(container)
    # mtc gives each pod the rank of its JobSet index; torchrun must use the same (static rendezvous).
    assert _flag(argv, "--node-rank") == "$(JOB_COMPLETION_INDEX)" and not _flags(argv, "--rdzv-backend")
    assert int(_flag(argv, "--nnodes")) == replicated["template"]["spec"]["parallelism"]
    assert (
        _flag(argv, "--master-addr")
        == f"{jobset['metadata']['name']}-{replicated['name']}-0-0.{jobset['metadata']['name']}"
    )
    (volume,) = [v for v in pod["volumes"] if "csi" in v]
    assert volume["csi"]["volumeAttributes"]["framework"] == "pytorch.distributed"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16Gi", 16 * 2**30), ("64Gi", 64 * 2**30), ("60000Mi", 60000 * 2**20), ("1G", 10**9), ("1e9", 10**9)],
)
def test_parse_quantity_reads_memory_sizes(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["-1Gi", "0.5", "1.5k5", "Gi", "", "12 GB"])
def test_parse_quantity_rejects_bad_input(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


@pytest.mark.parametrize("name", ["llama-train", "torch-train"])
def test_example_jobsets_rank0_address_is_the_pods_jobset_dns_name(name):
    """The coordinator writes rank 0's address as ``<pod name without suffix>.<subdomain>``; in a JobSet
    with DNS hostnames that resolves only when the subdomain is the JobSet's name (its headless Service)."""
    from csi_driver.volume_request import VolumeLimits, parse_volume_context
    from replicator.coordinator.indices.incarnations import _JOBSET_SUFFIX
    from replicator.local_tier import frameworks

    jobset = _one("JobSet", name)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "csi" in v]
    pod_name = f"{name}-{replicated['name']}-0-0-x7k2p"  # what JobSet and the Job controller name rank 0's pod
    context = {
        **volume["csi"]["volumeAttributes"],
        "csi.storage.k8s.io/pod.name": pod_name,
        "csi.storage.k8s.io/pod.namespace": "default",
    }
    spec = parse_volume_context(context, 1 << 30, VolumeLimits(frameworks=frozenset(frameworks.REGISTRY)))
    hostname = f"{name}-{replicated['name']}-0-0"  # JobSet's pod hostname
    assert f"{_JOBSET_SUFFIX.sub('', pod_name)}.{spec.subdomain}" == f"{hostname}.{jobset['metadata']['name']}"
    assert spec.job == f"{name}-{replicated['name']}"


# Kubernetes objects passed through whole: documented as one value.
_PASSED_THROUGH = ("resources", "updateStrategy", "strategy", "labels", "annotations", "volume", "affinity")


def _value_keys(values: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in _PASSED_THROUGH:
            keys += _value_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def test_chart_readme_documents_every_value():
    chart = REPO / "charts" / "mtc"
    with open(chart / "values.yaml", encoding="utf-8") as f:
        keys = _value_keys(yaml.safe_load(f))
    readme = (chart / "README.md").read_text()
    assert len(keys) > 50
    assert [k for k in keys if f"| `{k}` |" not in readme] == []
