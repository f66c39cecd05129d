"""The chart's values, rendered by the real ``helm`` (v3.22.0, ``make tools``).

- ``values.schema.json`` refuses bad values before anything renders (helm checks it on install,
  upgrade, template and lint): each case asserts helm's own message.
- Every operator knob reaches the pod specs; the image tag is the chart's appVersion.
- Renders are reproducible when the Secrets are the operator's (``existingSecret``), as GitOps needs.
- The ramdisks' host directory: an explicit ``dataDir``, else the installed DaemonSet's (``lookup``, asked of a
  stand-in API server), else one below the kubelet's root.
- The ``helm test`` Pod runs ``mtc status`` against the coordinator Service with the cluster CA.
- Peer TLS is on by default with the chart's own certificate (checked against its CA alone), mounted in the
  agents only and kept on upgrade; the operator's certificates are checked by name.
"""

import subprocess

import kubernetes_validate
import pytest
import yaml

from replicator import cli
from tests.helpers.chart import (
    CHART,
    KUBERNETES_VERSIONS,
    argv_of,
    by_key,
    container,
    flag,
    helm_template,
    pod_spec,
    run,
    template_argv,
)
from tests.helpers.lookup_api import LookupApi
from tests.helpers.tools import require_tool

SCHEMA_ERROR = "values don't meet the specifications of the schema(s)"
STATUS_POD = ("Pod", "mtc-test-status")
NODE = ("DaemonSet", "mtc-node")
DEFAULT_DATA_DIR = "/var/lib/kubelet/plugins/ramdisk.csi.mtc.dev/data"


def _app_version() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def _refused(argv: list[str]) -> str:
    """helm's output (lint reports on stdout, template on stderr); fails the test unless helm exited non-zero."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, f"{' '.join(argv)} was accepted"
    return done.stdout + done.stderr


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("replicas=3", "at '/replicas': value must be one of 1, 2"),
        ("backup.ulr=gs://bucket/mtc", "at '/backup': additional properties 'ulr' not allowed"),
        ("node.bakgroundCPU=0.5", "at '/node': additional properties 'bakgroundCPU' not allowed"),
        ("logging.level=verbose", "at '/logging/level': value must be one of 'debug', 'info', 'warning', 'error'"),
        ("logging.format=xml", "at '/logging/format': value must be one of 'text', 'json'"),
        ("backup.url=bucket/mtc", "at '/backup/url': 'bucket/mtc' does not match pattern"),
        ("backup.url=https://bucket/mtc", "at '/backup/url': 'https://bucket/mtc' does not match pattern"),
        ("backup.keep=three", "at '/backup/keep': got string, want integer"),
        ("ramdisk.defaultSize=12GB", "at '/ramdisk/defaultSize': '12GB' does not match pattern"),
        ("ramdisk.retentionSeconds=-1", "at '/ramdisk/retentionSeconds': minimum: got -1, want 0"),
        ("node.backgroundCPU=0", "at '/node/backgroundCPU': exclusiveMinimum: got 0, want 0"),
        ("node.wedgedAfterSeconds=-3", "at '/node/wedgedAfterSeconds': exclusiveMinimum: got -3, want 0"),
        ("coordinator.nodeTimeoutSeconds=soon", "at '/coordinator/nodeTimeoutSeconds': 'soon' does not match pattern"),
        ("node.extraArgs=--x", "at '/node/extraArgs': got string, want array"),
        (
            "image.pullPolicy=Sometimes",
            "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        (
            "sidecars.livenessProbe.pullPolicy=Sometimes",
            "at '/sidecars/livenessProbe/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        ("kubeletDir=5", "at '/kubeletDir': got number, want string"),
        ("kubeletDir=var/lib/kubelet", "at '/kubeletDir': 'var/lib/kubelet' does not match pattern"),
        ("dataDir=mtc", "at '/dataDir': 'mtc' does not match pattern"),
        ("dataDir=5", "at '/dataDir': got number, want string"),
        ("tls.existingSecret=My_Secret", "at '/tls/existingSecret': 'My_Secret' does not match pattern"),
        ("peerTLS.enabled=yes", "at '/peerTLS/enabled': got string, want boolean"),
        ("peerTLS.existingSecret=Peer_TLS", "at '/peerTLS/existingSecret': 'Peer_TLS' does not match pattern"),
        (
            "monitoring.runbookBaseUrl=https://wiki",
            "at '/monitoring': additional properties 'runbookBaseUrl' not allowed",
        ),
    ],
)
def test_schema_refuses_a_bad_value_before_rendering(setting, message):
    output = _refused(template_argv(setting))
    assert SCHEMA_ERROR in output and message in output, output


def test_lint_refuses_what_the_schema_refuses():
    output = _refused([require_tool("helm"), "lint", "--strict", str(CHART), "--set", "replicas=3"])
    assert "at '/replicas': value must be one of 1, 2" in output, output


def test_schema_accepts_every_documented_value_form():
    # Each good form of the values the schema checks by pattern renders (the cases above show it can refuse).
    for setting in (
        "backup.url=s3://my-bucket/a/b",
        "backup.url=file:///mnt/backups",
        "backup.url=gs://b",
        "ramdisk.defaultSize=60000Mi",
        "ramdisk.defaultSize=1e9",
        "replicas=2",
        "logging.level=debug",
        "logging.format=json",
        "node.backgroundCPU=0.5",
        "node.minPushIntervalSeconds=0",
        "coordinator.holderGraceSeconds=2.5",
        "peerTLS.enabled=true",
        "peerTLS.enabled=true,peerTLS.existingSecret=peer-tls",
        "peerTLS.enabled=false",
        "kubeletDir=/var/lib/k0s/kubelet",
        "dataDir=/mnt/mtc",
        "sidecars.livenessProbe.pullPolicy=Never",
    ):
        assert helm_template(setting), setting


def test_every_knob_renders_into_the_pod_specs(tmp_path):
    pod_knobs = {
        "extraArgs": ["--ramdisk-backend", "tmpfs"],
        "env": [{"name": "AWS_REGION", "value": "eu-west-1"}],
        "envFrom": [{"configMapRef": {"name": "proxy"}}],
        "podAnnotations": {"example.dev/owner": "ml-infra"},
        "podLabels": {"team": "ml"},
        "nodeSelector": {"pool": "tpu"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["tpu"]}]}]
                }
            }
        },
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "high",
        "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
    }
    values = {
        "imagePullSecrets": [{"name": "regcred"}],
        "maxNodes": 20000,
        "logging": {"level": "debug", "format": "json"},
        "peerTLS": {"enabled": True, "existingSecret": "peer-tls"},
        "node": {
            **pod_knobs,
            "backgroundCPU": 0.5,
            "restoreDeadlineSeconds": 200,
            "wedgedAfterSeconds": 90,
            "minPushIntervalSeconds": 5,
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
        },
        "coordinator": {
            **pod_knobs,
            "kubeNamespace": "training",
            "nodeTimeoutSeconds": 30,
            "holderGraceSeconds": 120,
            "restoreFanOut": False,
            "sharedBackupUpload": True,
            "strategy": {"type": "RollingUpdate"},
        },
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    rendered = by_key(helm_template(values=tmp_path / "values.yaml"))
    node, coordinator = rendered[("DaemonSet", "mtc-node")], rendered[("Deployment", "mtc-coordinator")]
    for obj in (node, coordinator, rendered[STATUS_POD]):  # each knob in its place: unknown fields are errors
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)

    agent = argv_of(container(node, "mtc-node"))
    assert {
        f: flag(agent, f)
        for f in (
            "--background-cpu",
            "--restore-deadline-seconds",
            "--wedged-after-seconds",
            "--min-push-interval-seconds",
            "--max-nodes",
            "--log-level",
            "--log-format",
            "--peer-tls-cert",
            "--peer-tls-key",
            "--peer-tls-ca",
        )
    } == {
        "--background-cpu": "0.5",
        "--restore-deadline-seconds": "200",
        "--wedged-after-seconds": "90",
        "--min-push-interval-seconds": "5",
        "--max-nodes": "20000",
        "--log-level": "debug",
        "--log-format": "json",
        "--peer-tls-cert": "/etc/mtc/peer-tls/tls.crt",
        "--peer-tls-key": "/etc/mtc/peer-tls/tls.key",
        "--peer-tls-ca": "/etc/mtc/peer-tls/ca.crt",
    }
    assert agent[-2:] == ["--ramdisk-backend", "tmpfs"], "extraArgs come last"
    peer_tls = next(v for v in pod_spec(node)["volumes"] if v["name"] == "peer-tls")
    assert peer_tls["secret"]["secretName"] == "peer-tls"
    assert node["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"

    served = argv_of(container(coordinator, "mtc-coordinator"))
    assert {
        f: flag(served, f)
        for f in (
            "--node-timeout-seconds",
            "--holder-grace-seconds",
            "--kube-namespace",
            "--max-nodes",
            "--log-level",
            "--log-format",
        )
    } == {
        "--node-timeout-seconds": "30",
        "--holder-grace-seconds": "120",
        "--kube-namespace": "training",
        "--max-nodes": "20000",
        "--log-level": "debug",
        "--log-format": "json",
    }
    assert "--no-restore-fan-out" in served and "--shared-backup-upload" in served
    assert coordinator["spec"]["strategy"] == {"type": "RollingUpdate"}

    for obj, name in ((node, "mtc-node"), (coordinator, "mtc-coordinator")):
        spec, main = pod_spec(obj), container(obj, name)
        assert argv_of(main)[-2:] == ["--ramdisk-backend", "tmpfs"]
        assert {"name": "AWS_REGION", "value": "eu-west-1"} in main["env"]
        assert main["envFrom"] == [{"configMapRef": {"name": "proxy"}}]
        assert main["resources"] == pod_knobs["resources"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        for key in ("nodeSelector", "affinity", "tolerations", "priorityClassName"):
            assert spec[key] == pod_knobs[key], (name, key)
        template = obj["spec"]["template"]["metadata"]
        assert template["annotations"]["example.dev/owner"] == "ml-infra"
        assert template["labels"]["team"] == "ml"
        assert template["labels"]["app.kubernetes.io/name"] == "mtc", "the selector's labels stay"


def _unknown_flags(argv: list[str]) -> list[str]:
    """The ``--flags`` in a rendered ``mtc`` command line that its subcommand does not take."""
    command = next(a for a in argv if not a.startswith("-") and a != "mtc")
    known = cli.parser()._subparsers._group_actions[0].choices[command]._option_string_actions
    return [a for a in argv if a.startswith("--") and a.split("=")[0] not in known]


@pytest.mark.parametrize(
    "setting",
    [
        [],
        [
            "peerTLS.enabled=true,peerTLS.existingSecret=peer-tls,maxNodes=500,node.backgroundCPU=0.5,logging.level=debug,"
            "coordinator.nodeTimeoutSeconds=30,coordinator.kubeNamespace=training"
        ],
    ],
)
def test_every_rendered_command_line_is_one_the_program_takes(setting):
    """A flag the program does not take crash-loops every pod of the DaemonSet: none is rendered."""
    rendered = by_key(helm_template(*setting))
    for key, name in (
        (("DaemonSet", "mtc-node"), "mtc-node"),
        (("Deployment", "mtc-coordinator"), "mtc-coordinator"),
        (STATUS_POD, "mtc-status"),
    ):
        argv = argv_of(container(rendered[key], name))
        assert _unknown_flags(argv) == [], (name, argv)


def test_unset_flags_leave_the_programs_defaults():
    rendered = by_key(helm_template())
    agent = argv_of(container(rendered[("DaemonSet", "mtc-node")], "mtc-node"))
    served = argv_of(container(rendered[("Deployment", "mtc-coordinator")], "mtc-coordinator"))
    unset = {
        "--background-cpu",
        "--restore-deadline-seconds",
        "--wedged-after-seconds",
        "--min-push-interval-seconds",
        "--node-timeout-seconds",
        "--holder-grace-seconds",
        "--kube-namespace",
    }
    assert not unset & set(agent + served)
    for argv in (agent, served):
        assert (flag(argv, "--log-level"), flag(argv, "--log-format")) == ("info", "text")
        assert argv.index("--log-level") > 1, "after the subcommand"


def test_peer_tls_can_come_from_a_volume_of_the_operators(tmp_path):
    # e.g. cert-manager's csi-driver, which issues each pod a certificate for its own IP.
    volume = {
        "csi": {
            "driver": "csi.cert-manager.io",
            "readOnly": True,
            "volumeAttributes": {
                "csi.cert-manager.io/issuer-name": "mtc-peers",
                "csi.cert-manager.io/ip-sans": "${POD_IP}",
            },
        }
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump({"peerTLS": {"enabled": True, "volume": volume}}))
    rendered = by_key(helm_template(values=tmp_path / "values.yaml"))
    peer_tls = next(v for v in pod_spec(rendered[("DaemonSet", "mtc-node")])["volumes"] if v["name"] == "peer-tls")
    assert peer_tls == {"name": "peer-tls", **volume}


PEER_TLS_FLAGS = {
    "--peer-tls-cert": "/etc/mtc/peer-tls/tls.crt",
    "--peer-tls-key": "/etc/mtc/peer-tls/tls.key",
    "--peer-tls-ca": "/etc/mtc/peer-tls/ca.crt",
}


def _peer_tls(rendered: dict) -> tuple[dict, list[str]]:
    """The flags of the agent's peer TLS (each None when absent) and the (kind, name, container) of every
    container that mounts the peer TLS volume or names a peer TLS Secret, in any rendered pod."""
    agent = argv_of(container(rendered[NODE], "mtc-node"))
    flags = {f: flag(agent, f) for f in (*PEER_TLS_FLAGS, "--peer-tls-check")}
    holders = []
    for (kind, name), obj in rendered.items():
        if kind not in ("DaemonSet", "Deployment", "Pod"):
            continue
        spec = pod_spec(obj)
        volumes = {
            v["name"] for v in spec.get("volumes", []) if v["name"] == "peer-tls" or "peer-tls" in str(v.get("secret"))
        }
        for c in spec["containers"]:
            if {m["name"] for m in c.get("volumeMounts", [])} & volumes:
                holders.append((kind, name, c["name"]))
    return flags, holders


def test_peer_tls_is_on_by_default_with_the_charts_certificate_in_the_agents_only():
    rendered = by_key(helm_template())
    flags, holders = _peer_tls(rendered)
    assert flags == {**PEER_TLS_FLAGS, "--peer-tls-check": "ca"}
    assert holders == [("DaemonSet", "mtc-node", "mtc-node")]  # not the coordinator, the sidecar or the test Pod
    (volume,) = [v for v in pod_spec(rendered[NODE])["volumes"] if v["name"] == "peer-tls"]
    assert volume["secret"] == {"secretName": "mtc-peer-tls", "defaultMode": 0o400}
    assert rendered[("Secret", "mtc-peer-tls")]["type"] == "kubernetes.io/tls"


def test_peer_tls_from_the_operators_secret_is_checked_by_name_and_off_renders_none():
    rendered = by_key(helm_template("peerTLS.existingSecret=peer-tls"))
    flags, holders = _peer_tls(rendered)
    assert flags == {**PEER_TLS_FLAGS, "--peer-tls-check": None}  # the agent's default: name
    assert holders == [("DaemonSet", "mtc-node", "mtc-node")]
    assert ("Secret", "mtc-peer-tls") not in rendered

    rendered = by_key(helm_template("peerTLS.enabled=false"))
    flags, holders = _peer_tls(rendered)
    assert set(flags.values()) == {None} and holders == []
    assert ("Secret", "mtc-peer-tls") not in rendered


def test_an_upgrade_keeps_the_installed_peer_certificate(tmp_path):
    installed = by_key(helm_template())[("Secret", "mtc-peer-tls")]
    with LookupApi([installed], tmp_path) as cluster:
        kept = by_key(helm_template(kubeconfig=cluster.kubeconfig))[("Secret", "mtc-peer-tls")]
        assert "/api/v1/namespaces/mtc-system/secrets/mtc-peer-tls" in cluster.requests
    assert kept["data"] == installed["data"]
    assert by_key(helm_template())[("Secret", "mtc-peer-tls")]["data"] != installed["data"]  # else a fresh CA


def test_image_tag_defaults_to_the_charts_app_version():
    rendered = by_key(helm_template())
    images = {
        c["image"]
        for obj in rendered.values()
        if obj["kind"] in ("DaemonSet", "Deployment", "Pod")
        for c in pod_spec(obj)["containers"]
        if c["name"] != "liveness-probe"
    }
    assert images == {f"mtc-agent:{_app_version()}"}
    assert _app_version() != "latest"


def test_renders_with_existing_secrets_are_identical():
    settings = (
        "token.existingSecret=mtc-token",
        "tls.existingSecret=mtc-coordinator-tls",
        "peerTLS.existingSecret=peers",
    )
    first, second = run(template_argv(*settings)), run(template_argv(*settings))
    assert first == second
    assert "kind: Secret" not in first
    # Without them, helm template (no cluster to look up) generates new ones each time: why GitOps needs them.
    assert run(template_argv()) != run(template_argv())


def test_helm_test_pod_runs_status_against_the_coordinator_service_with_the_cluster_ca():
    rendered = by_key(helm_template("tls.existingSecret=mtc-coordinator-tls"))
    pod = rendered[STATUS_POD]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (main,) = pod["spec"]["containers"]
    argv = argv_of(main)
    assert argv[:2] == ["mtc", "status"]
    service = rendered[("Service", "mtc-coordinator")]
    assert (
        flag(argv, "--coordinator")
        == f"https://{service['metadata']['name']}.mtc-system.svc:{service['spec']['ports'][0]['port']}"
    )
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert flag(argv, "--ca") == f"{mounts['tls-ca']}/ca.crt"
    # Operator identity: it sends a token of its own ServiceAccount, for the API server's audience.
    assert flag(argv, "--token-file") == f"{mounts['operator-token']}/token"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tls-ca"]["secret"] == {
        "secretName": "mtc-coordinator-tls",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    assert volumes["operator-token"]["projected"]["sources"] == [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}}
    ]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert main["image"] == container(rendered[("Deployment", "mtc-coordinator")], "mtc-coordinator")["image"]


def test_helm_test_pod_follows_tls_and_can_be_left_out():
    plain = by_key(helm_template("tls.enabled=false"))[STATUS_POD]
    argv = argv_of(plain["spec"]["containers"][0])
    assert flag(argv, "--coordinator") == "http://mtc-coordinator.mtc-system.svc:8471" and "--ca" not in argv
    for settings in (["operatorIdentity.enabled=false"], ["coordinator.kube=false"]):  # status needs no token
        pod = by_key(helm_template("tls.enabled=false", *settings))[STATUS_POD]
        assert "--token-file" not in argv_of(pod["spec"]["containers"][0]) and "volumes" not in pod["spec"]
    assert STATUS_POD not in by_key(helm_template("tests.enabled=false"))


def _data_dirs(rendered: list[dict]) -> set[str]:
    """Every place the node DaemonSet names the ramdisks' directory: the agent's --root and $MTC_ROOT
    (``mtc gc``'s default), the data-root mount and its host path; one value when they agree."""
    node = by_key(rendered)[NODE]
    agent = container(node, "mtc-node")
    (volume,) = [v for v in pod_spec(node)["volumes"] if v["name"] == "data-root"]
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == "data-root"]
    assert mount["mountPropagation"] == "Bidirectional"
    env = {e["name"]: e.get("value") for e in agent["env"]}
    return {flag(argv_of(agent), "--root"), env["MTC_ROOT"], mount["mountPath"], volume["hostPath"]["path"]}


@pytest.mark.parametrize(
    ("settings", "data_dir"),
    [
        ([], DEFAULT_DATA_DIR),
        (
            ["kubeletDir=/var/lib/k0s/kubelet", "driverName=ram.example.dev"],
            "/var/lib/k0s/kubelet/plugins/ram.example.dev/data",
        ),
        (["dataDir=/mnt/mtc"], "/mnt/mtc"),
    ],
)
def test_a_new_install_puts_the_ramdisks_below_the_kubelets_root_unless_data_dir_says(settings, data_dir):
    # The kubelet makes its root a shared mount, which a Bidirectional mount needs; a host's / may not be one.
    assert _data_dirs(helm_template(*settings)) == {data_dir}


def test_an_upgrade_keeps_the_data_dir_of_the_installed_daemonset(tmp_path):
    # An install of 0.2.0, whose default was /var/lib/mtc: its ramdisks stay where they are mounted.
    installed = by_key(helm_template("dataDir=/var/lib/mtc"))[NODE]
    lookup = "/apis/apps/v1/namespaces/mtc-system/daemonsets/mtc-node"
    with LookupApi([installed], tmp_path) as cluster:
        assert _data_dirs(helm_template(kubeconfig=cluster.kubeconfig)) == {"/var/lib/mtc"}
        assert lookup in cluster.requests
        assert _data_dirs(helm_template("dataDir=/mnt/mtc", kubeconfig=cluster.kubeconfig)) == {"/mnt/mtc"}
    with LookupApi([], tmp_path) as cluster:  # asked, and nothing installed
        assert _data_dirs(helm_template(kubeconfig=cluster.kubeconfig)) == {DEFAULT_DATA_DIR}
        assert lookup in cluster.requests


def test_the_livenessprobe_sidecar_has_its_own_pull_policy():
    # image.pullPolicy=Never is for our image, loaded onto the nodes; the sidecar's comes from its registry.
    rendered = by_key(helm_template("image.pullPolicy=Never"))
    policies = {
        c["name"]: c["imagePullPolicy"]
        for obj in rendered.values()
        if obj["kind"] in ("DaemonSet", "Deployment", "Pod")
        for c in pod_spec(obj)["containers"]
    }
    assert policies == {
        "mtc-node": "Never",
        "liveness-probe": "IfNotPresent",
        "mtc-coordinator": "Never",
        "mtc-status": "Never",
    }
    node = by_key(helm_template("sidecars.livenessProbe.pullPolicy=Always"))[NODE]
    assert container(node, "liveness-probe")["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(
    "settings, identity, grants",
    [
        ((), True, True),
        (("nodeIdentity.peerGrants=false",), True, False),
        (("nodeIdentity.enabled=false",), False, False),
        (("coordinator.kube=false",), False, False),
    ],
)
def test_per_node_identity_turns_on_peer_grants_in_the_coordinator_and_every_agent(settings, identity, grants):
    rendered = by_key(helm_template(*settings))
    coordinator = argv_of(container(rendered[("Deployment", "mtc-coordinator")], "mtc-coordinator"))
    agent = argv_of(container(rendered[NODE], "mtc-node"))
    assert ("--node-identity" in coordinator, "--node-token-file" in agent) == (identity, identity)
    assert ("--peer-grants" in coordinator, "--peer-grants" in agent) == (grants, grants)


@pytest.mark.parametrize(
    "settings, identity, aggregated",
    [
        ((), True, True),
        (("operatorIdentity.aggregateToDefaultRoles=false",), True, False),
        (("operatorIdentity.enabled=false",), False, False),
        (("coordinator.kube=false",), False, False),
    ],
)
def test_operator_identity_ships_the_operators_roles_and_lets_the_coordinator_ask_rbac(settings, identity, aggregated):
    rendered = by_key(helm_template(*settings))
    coordinator = argv_of(container(rendered[("Deployment", "mtc-coordinator")], "mtc-coordinator"))
    assert ("--operator-identity" in coordinator) == identity
    rules = rendered[("ClusterRole", "mtc-coordinator")]["rules"]
    asks = {"subjectaccessreviews"} & {r for rule in rules for r in rule["resources"]}
    assert bool(asks) == identity
    roles = [rendered.get(("ClusterRole", name)) for name in ("mtc-checkpoint-viewer", "mtc-rollback")]
    assert all(roles) if identity else not any(roles)
    labels = [set(role["metadata"]["labels"]) for role in roles if role]
    assert [any("aggregate-to" in label for label in names) for names in labels] == [aggregated] * len(labels)
