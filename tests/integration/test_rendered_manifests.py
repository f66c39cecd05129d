"""The install paths, rendered by the real tools and checked against real schemas.

- ``helm lint --strict`` and ``helm template`` of ``charts/mtc`` (helm v3.22.0), ``kustomize build``
  of ``manifests/`` and ``manifests/monitoring/`` (kustomize v5.7.1), all from ``.tools/bin``.
- Every built-in object validated in strict mode (unknown fields are errors) by PyPI
  ``kubernetes-validate`` against the oldest and the newest Kubernetes version we support.
- Custom resources validated with ``jsonschema`` against their CRD's schema, vendored in
  ``tests/schemas/`` and made strict the same way: the example JobSet (kubernetes-sigs/jobset
  v0.10.1) and the ServiceMonitors and PrometheusRule (prometheus-operator v0.82.0).
- The chart and the kustomize base agree on every contract field: they render the same specs.
"""

import base64
import contextlib
import copy
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from replicator.wire.tls import ServerCheck, client_context
from tests.helpers import REPO
from tests.helpers.chart import CHART, KUBERNETES_VERSIONS, helm_template
from tests.helpers.chart import argv_of as _argv
from tests.helpers.chart import by_key as _by_key
from tests.helpers.chart import container as _container
from tests.helpers.chart import docs as _docs
from tests.helpers.chart import flag as _flag
from tests.helpers.chart import pod_spec as _pod_spec
from tests.helpers.chart import run as _run
from tests.helpers.markdown import prose_lines
from tests.helpers.tools import require_tool

MANIFESTS = REPO / "manifests"
MONITORING = MANIFESTS / "monitoring"
SCHEMAS = REPO / "tests" / "schemas"
# (apiVersion, kind) -> the vendored openAPIV3Schema of its CRD (each file's $comment names its source).
CRD_SCHEMAS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): SCHEMAS / "jobset-v0.10.1-v1alpha2.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "prometheus-operator-v0.82.0-servicemonitors-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheus-operator-v0.82.0-prometheusrules-v1.json",
    ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig"): SCHEMAS
    / "prometheus-operator-v0.82.0-alertmanagerconfigs-v1alpha1.json",
}
ALL_MONITORING = [
    "serviceMonitor.enabled=true",
    "prometheusRule.enabled=true",
    "grafanaDashboard.enabled=true",
    "monitoring.alertmanagerConfig.enabled=true",
]
# The chart's own peer certificate (the default), the operator's Secret, a volume of theirs, none.
PEER_TLS_FORMS = [
    "peerTLS.enabled=true",
    "peerTLS.existingSecret=my-peer-tls",
    "peerTLS.volume.csi.driver=csi.cert-manager.io",
    "peerTLS.enabled=false",
]


def kustomize_build(directory: Path) -> list[dict]:
    return _docs(_run([require_tool("kustomize"), "build", str(directory)]))


def _documented_set_image() -> str:
    """The one command docs/install.md's kustomize section gives to point the base at a registry."""

    page = REPO / "docs" / "install.md"
    lines, prose = page.read_text(encoding="utf-8").splitlines(), prose_lines(page)
    start = prose.index("## kustomize")
    end = next(i for i in range(start + 1, len(prose)) if prose[i].startswith("## "))
    (command,) = [line.strip() for line in lines[start:end] if "kustomize edit set image" in line]
    return command


def test_the_documented_set_image_command_points_the_base_at_a_registry(tmp_path):
    # The base alone names mtc-agent:<release> with no registry (an ImagePullBackOff): the documented command,
    # run as written in a copy of the checkout with kustomize on PATH, must point both workloads at REGISTRY.
    command = _documented_set_image()
    assert command.startswith("(cd manifests && ") and "REGISTRY/mtc-agent:TAG" in command
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    tool_dir = str(Path(require_tool("kustomize")).parent)
    script = command.replace("REGISTRY", "registry.example/team").replace("TAG", "9.9.9-rc1")
    env = {**os.environ, "PATH": f"{tool_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    images = [
        c["image"]
        for o in kustomize_build(tmp_path / "manifests")
        if o["kind"] in ("DaemonSet", "Deployment")
        for c in o["spec"]["template"]["spec"]["containers"]
        if "mtc-agent" in c["image"]
    ]
    assert images == ["registry.example/team/mtc-agent:9.9.9-rc1"] * 2
    assert (MANIFESTS / "kustomization.yaml").read_text() != (tmp_path / "manifests" / "kustomization.yaml").read_text()


def test_helm_lint_is_clean_with_every_toggle():
    for settings in ([], ALL_MONITORING, ["tls.enabled=false", "backup.url=gs://b/p"]):
        argv = [require_tool("helm"), "lint", "--strict", str(CHART)]
        for setting in settings:
            argv += ["--set", setting]
        assert "0 chart(s) failed" in _run(argv)


@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
def test_rendered_objects_are_valid_in_strict_mode(kube_version):
    rendered = {
        "helm (defaults)": helm_template(kube_version=kube_version),
        "helm (every toggle)": helm_template(
            *ALL_MONITORING,
            "backup.url=gs://b/p",
            "backup.credentials.secretName=c",
            "backup.credentials.fileEnv.GOOGLE_APPLICATION_CREDENTIALS=key.json",
            kube_version=kube_version,
        ),
        "helm (no TLS)": helm_template("tls.enabled=false", "peerTLS.enabled=false", kube_version=kube_version),
        "helm (operator's peer TLS)": helm_template("peerTLS.existingSecret=my-peer-tls", kube_version=kube_version),
        "kustomize manifests/": kustomize_build(MANIFESTS),
        "kustomize manifests/monitoring/": kustomize_build(MONITORING),
    }
    checked = set()
    for source, docs in rendered.items():
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
                continue  # test_custom_resources_match_their_crd_schemas
            try:
                kubernetes_validate.validate(doc, kube_version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(
                    f"{source}: {doc['kind']} {doc['metadata']['name']} is invalid for {kube_version}: "
                    f"{str(err).splitlines()[0]} at {list(err.path)}"
                )
            checked.add(doc["kind"])
    assert {
        "CSIDriver",
        "DaemonSet",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Secret",
        "ConfigMap",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    } <= checked


def test_strict_validation_rejects_an_unknown_field():
    # The check above can fail: a misspelt field is an error, not silently dropped.
    daemonset = _by_key(kustomize_build(MANIFESTS))[("DaemonSet", "mtc-node")]
    _container(daemonset, "mtc-node")["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[0], strict=True)


def _strict(schema):
    """Rejects unknown fields, as the API server's strict field validation does: every object
    schema with properties and no x-kubernetes-preserve-unknown-fields gets additionalProperties false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {k: _strict(v) for k, v in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict.setdefault("additionalProperties", False)
    return strict


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(CRD_SCHEMAS[(api_version, kind)].read_text())
    return jsonschema.Draft202012Validator(_strict(schema))


def _example_jobset(name: str = "example-jobset.yaml") -> dict:
    with open(MANIFESTS / name, encoding="utf-8") as f:
        (jobset,) = _docs(f.read())
    return jobset


def test_custom_resources_match_their_crd_schemas():
    resources = [(name, _example_jobset(name)) for name in ("example-jobset.yaml", "example-torchrun-jobset.yaml")]
    for peer_tls in PEER_TLS_FORMS:
        resources += [
            (f"chart ({peer_tls})", d)
            for d in helm_template(*ALL_MONITORING, peer_tls)
            if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS
        ]
    resources += [
        ("manifests/monitoring/", d) for d in kustomize_build(MONITORING) if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS
    ]
    assert {d["kind"] for _, d in resources} == {"JobSet", "ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"}
    for source, doc in resources:
        errors = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)
        ]
        assert not errors, f"{source}: {doc['kind']} {doc['metadata']['name']}: {errors}"


def test_crd_schema_rejects_a_misspelt_field():
    jobset = _example_jobset()
    jobset["spec"]["replicatedJobs"][0]["replica"] = 2
    assert any("replica" in e.message for e in crd_validator(jobset["apiVersion"], "JobSet").iter_errors(jobset))


# -- the chart and the kustomize base install the same thing --------------------------------------

# Labels and annotations differ on purpose (the chart adds helm's); selectors are compared in spec.
_PRESENTATION = ("labels", "annotations")


def _contract(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    for key in _PRESENTATION:
        obj["metadata"].pop(key, None)
    template = obj.get("spec", {}).get("template", {}).get("metadata")
    if template is not None:
        for key in _PRESENTATION:
            template.pop(key, None)
    return obj


def test_chart_and_kustomize_base_render_the_same_objects():
    # Secrets: the chart generates the token and TLS Secrets the base asks the operator to create.
    # Namespace: helm installs into a namespace that exists (docs/install.md, Helm: create and label it first).
    # The Pod: the chart's `helm test` hook. Peer TLS: the base leaves it off (the chart's own test below).
    chart = _by_key(helm_template("peerTLS.enabled=false"))
    base = _by_key(kustomize_build(MANIFESTS))
    assert set(chart) - set(base) == {("Secret", "mtc-peer-token"), ("Secret", "mtc-tls"), ("Pod", "mtc-test-status")}
    assert set(base) - set(chart) == {("Namespace", "mtc-system")}
    for key in sorted(set(chart) & set(base)):
        assert _contract(chart[key]) == _contract(base[key]), f"{key} differs between the chart and manifests/"


def test_chart_monitoring_is_the_monitoring_base():
    chart = _by_key(helm_template(*ALL_MONITORING, "peerTLS.enabled=false"))  # the base's agents serve plain HTTP
    base = _by_key(kustomize_build(MONITORING))
    for key, obj in base.items():
        assert key in chart, f"the chart has no {key}"
        assert _contract(chart[key]) == _contract(obj), f"{key} differs between the chart and manifests/monitoring/"
    dashboard = json.loads(chart[("ConfigMap", "mtc-dashboard")]["data"]["mtc-dashboard.json"])
    assert dashboard == json.loads((MONITORING / "mtc-dashboard.json").read_text())
    assert chart[("ConfigMap", "mtc-dashboard")]["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_node_service_monitor_scrapes_the_agents_as_they_serve():
    def endpoint(*settings: str) -> dict:
        (scraped,) = _by_key(helm_template("serviceMonitor.enabled=true", *settings))[("ServiceMonitor", "mtc-node")][
            "spec"
        ]["endpoints"]
        return {k: scraped.get(k) for k in ("scheme", "tlsConfig")}

    generated_ca = {"secret": {"name": "mtc-peer-tls", "key": "ca.crt"}}
    assert endpoint() == {"scheme": "https", "tlsConfig": {"ca": generated_ca, "serverName": "mtc-node"}}
    # The operator's certificate names each pod IP, which Prometheus checks as the target's address.
    assert endpoint("peerTLS.existingSecret=my-peer-tls") == {
        "scheme": "https",
        "tlsConfig": {"ca": {"secret": {"name": "my-peer-tls", "key": "ca.crt"}}},
    }
    assert endpoint("peerTLS.volume.csi.driver=csi.cert-manager.io") == {
        "scheme": "https",
        "tlsConfig": {"insecureSkipVerify": True},
    }
    assert endpoint("peerTLS.enabled=false") == {"scheme": None, "tlsConfig": None}  # plain HTTP, as manifests/


def test_chart_rules_follow_the_release_namespace_and_the_runbook_base():
    docs = _by_key(
        helm_template(
            "prometheusRule.enabled=true",
            "monitoring.alertmanagerConfig.enabled=true",
            "monitoring.runbookBaseURL=https://wiki.example/mtc/",
            namespace="ops",
        )
    )
    rules = [r for g in docs[("PrometheusRule", "mtc")]["spec"]["groups"] for r in g["rules"]]
    for rule in rules:
        assert (
            rule["annotations"]["runbook_url"] == f"https://wiki.example/mtc/troubleshooting.md#{rule['alert'].lower()}"
        )
        assert rule["labels"]["namespace"] == "ops"
        assert "mtc-system" not in rule["expr"]
    (down,) = [r for r in rules if r["alert"] == "MTCCoordinatorDown"]
    assert down["expr"] == 'absent(up{job="mtc-coordinator",namespace="ops"} == 1)'
    # The Alertmanager inhibit rule holds back what the rules hold back while the coordinator is down.
    inhibit = docs[("AlertmanagerConfig", "mtc-inhibit")]
    assert inhibit["metadata"]["namespace"] == "ops"
    ((rule),) = inhibit["spec"]["inhibitRules"]
    assert rule["sourceMatch"] == [{"name": "alertname", "value": "MTCCoordinatorDown"}]
    held = {r["alert"] for r in rules if down["expr"] in r["expr"] and r is not down}
    assert set(rule["targetMatch"][0]["value"].split("|")) == held and rule["targetMatch"][0]["matchType"] == "=~"
    assert ("AlertmanagerConfig", "mtc-inhibit") not in _by_key(
        helm_template("prometheusRule.enabled=true")
    )  # off by default


def test_chart_secrets_hold_a_token_and_a_certificate_for_the_coordinator_service(tmp_path):
    secrets = {d["metadata"]["name"]: d for d in helm_template() if d["kind"] == "Secret"}
    token = base64.b64decode(secrets["mtc-peer-token"]["data"]["token"])
    assert len(token) == 64
    tls = {k: base64.b64decode(v) for k, v in secrets["mtc-tls"]["data"].items()}
    assert set(tls) == {"tls.crt", "tls.key", "ca.crt"}
    cert, ca = x509.load_pem_x509_certificate(tls["tls.crt"]), x509.load_pem_x509_certificate(tls["ca.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "mtc-coordinator.mtc-system.svc" in names  # the host in the agents' --coordinator URL
    assert cert.issuer == ca.subject
    _assert_p256(cert, ca)
    cert.verify_directly_issued_by(ca)
    for name, data in tls.items():
        (tmp_path / name).write_bytes(data)
    assert _tls_handshake(tmp_path, "mtc-coordinator.mtc-system.svc") == "TLSv1.3"


def test_chart_generates_a_peer_ca_and_one_certificate_every_agent_serves(tmp_path):
    secrets = {d["metadata"]["name"]: d for d in helm_template() if d["kind"] == "Secret"}
    assert secrets["mtc-peer-tls"]["type"] == "kubernetes.io/tls"
    peer = {k: base64.b64decode(v) for k, v in secrets["mtc-peer-tls"]["data"].items()}
    assert set(peer) == {"tls.crt", "tls.key", "ca.crt"}
    cert, ca = x509.load_pem_x509_certificate(peer["tls.crt"]), x509.load_pem_x509_certificate(peer["ca.crt"])
    cert.verify_directly_issued_by(ca)
    _assert_p256(cert, ca)
    coordinator_ca = x509.load_pem_x509_certificate(base64.b64decode(secrets["mtc-tls"]["data"]["ca.crt"]))
    assert ca.public_key() != coordinator_ca.public_key(), "a CA of its own: no agent can pose as the coordinator"
    for name, data in peer.items():
        (tmp_path / name).write_bytes(data)
    # A peer reaches an agent at its pod IP, which the certificate cannot name: the agents' `ca` check takes it,
    # the `name` check would not.
    agents_check = client_context(str(tmp_path / "ca.crt"), ServerCheck.CA)
    assert agents_check is not None
    assert _tls_handshake(tmp_path, "127.0.0.1", agents_check) == "TLSv1.3"
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        _tls_handshake(tmp_path, "127.0.0.1")
    assert _tls_handshake(tmp_path, "mtc-node") == "TLSv1.3"  # the name the node ServiceMonitor checks


def _assert_p256(*certs: x509.Certificate) -> None:
    """ECDSA P-256 keys: a handshake signs with the server's key, and at a 10,000-node coordinator restart RSA-2048's
    signatures took a quarter of its CPU (docs/scale.md)."""
    for cert in certs:
        key = cert.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1", cert.subject


def _tls_handshake(directory: Path, host: str, client: ssl.SSLContext | None = None) -> str:
    """A real TLS handshake: a server with ``directory``'s tls.crt/tls.key, a client that checks
    it (``client``, else against ca.crt for ``host``), strictly (RFC 5280, as Python 3.13 does by default).

    Raises:
      ssl.SSLCertVerificationError: the client refused the certificate.
    """
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(directory / "tls.crt", directory / "tls.key")
    client = client or ssl.create_default_context(cafile=directory / "ca.crt")
    client.verify_flags |= ssl.VERIFY_X509_STRICT

    def serve(listener: socket.socket) -> None:
        connection = listener.accept()[0]
        with connection, contextlib.suppress(ssl.SSLError):  # the client's refusal, as an alert
            server.wrap_socket(connection, server_side=True).close()

    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted = threading.Thread(target=serve, args=(listener,))
        accepted.start()
        try:
            with (
                socket.create_connection(listener.getsockname()) as raw,
                client.wrap_socket(raw, server_hostname=host) as tls,
            ):
                return str(tls.version())
        finally:
            accepted.join(10)


def test_chart_values_reach_the_agents_and_the_coordinator():
    rendered = _by_key(
        helm_template(
            "image.repository=registry.example/mtc",
            "image.tag=1.2.3",
            "driverName=ram.example.dev",
            "ramdisk.defaultSize=8Gi",
            "ramdisk.retentionSeconds=600",
            "replicas=2",
            "blockLabel=example.dev/rack",
            "backup.url=s3://bucket/prefix",
            "backup.keep=5",
            "backup.s3EndpointURL=https://s3.example:9000",
            "backup.credentials.secretName=s3-creds",
            "backup.credentials.fileEnv.AWS_SHARED_CREDENTIALS_FILE=credentials",
            "node.priorityClassName=high",
            "node.topologyOverride.block=rack-7",
            "node.topologyOverride.zone=z-$(NODE_NAME)",
            "node.nodeSelector.pool=tpu",
            "node.resources.requests.cpu=2",
            "token.existingSecret=my-token",
            "tls.existingSecret=my-tls",
            "peerTLS.existingSecret=my-peer-tls",
            "admissionPolicy.namespaceLabel=example.dev/ckpt",
        )
    )
    node = rendered[("DaemonSet", "mtc-node")]
    agent = _container(node, "mtc-node")
    argv = _argv(agent)
    assert agent["image"] == "registry.example/mtc:1.2.3"
    expected = {
        "--driver-name": "ram.example.dev",
        "--default-size": "8Gi",
        "--retention-seconds": "600",
        "--replicas": "2",
        "--backup": "s3://bucket/prefix",
        "--backup-keep": "5",
        "--s3-endpoint-url": "https://s3.example:9000",
        "--coordinator": "https://mtc-coordinator.mtc-system.svc:8471",
    }
    assert {flag: _flag(argv, flag) for flag in expected} == expected
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--topology"] == ["block=rack-7", "zone=z-$(NODE_NAME)"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["AWS_SHARED_CREDENTIALS_FILE"]["value"] == "/etc/mtc/backup-credentials/credentials"
    volumes = {v["name"]: v for v in _pod_spec(node)["volumes"]}
    assert volumes["backup-credentials"]["secret"]["secretName"] == "s3-creds"
    assert volumes["peer-token"]["secret"]["secretName"] == "my-token"
    assert volumes["tls-ca"]["secret"]["secretName"] == "my-tls"
    assert volumes["peer-tls"]["secret"]["secretName"] == "my-peer-tls"
    assert "--peer-tls-check" not in argv  # the operator's certificates name each agent: the name is checked
    assert _pod_spec(node)["priorityClassName"] == "high"
    assert _pod_spec(node)["nodeSelector"] == {"pool": "tpu"}
    assert agent["resources"]["requests"]["cpu"] == 2
    assert _flag(argv, "--csi-endpoint") == "unix:///var/lib/kubelet/plugins/ram.example.dev/csi.sock"
    assert "/var/lib/kubelet/plugins/ram.example.dev" in {m["mountPath"] for m in agent["volumeMounts"]}
    coordinator = _argv(_container(rendered[("Deployment", "mtc-coordinator")], "mtc-coordinator"))
    assert {flag: _flag(coordinator, flag) for flag in ("--driver-name", "--block-label")} == {
        "--driver-name": "ram.example.dev",
        "--block-label": "example.dev/rack",
    }
    assert ("CSIDriver", "ram.example.dev") in rendered
    assert not {k for k in rendered if k[0] == "Secret"}, "existing Secrets are referenced, not generated"
    policy = rendered[("ValidatingAdmissionPolicyBinding", "mtc-ramdisk-namespaces")]
    assert policy["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["key"] == "example.dev/ckpt"


def test_chart_without_kube_runs_the_coordinator_without_api_access():
    rendered = _by_key(helm_template("coordinator.kube=false"))
    coordinator = rendered[("Deployment", "mtc-coordinator")]
    argv = _argv(_container(coordinator, "mtc-coordinator"))
    assert not {"--kube", "--block-label", "--driver-name"} & set(argv)
    assert _pod_spec(coordinator)["automountServiceAccountToken"] is False
    agent = _argv(_container(rendered[("DaemonSet", "mtc-node")], "mtc-node"))
    assert "--topology" not in agent  # node.topologyOverride is empty by default


def test_chart_without_tls_serves_and_calls_plain_http():
    rendered = _by_key(helm_template("tls.enabled=false"))
    agent = _argv(_container(rendered[("DaemonSet", "mtc-node")], "mtc-node"))
    assert _flag(agent, "--coordinator") == "http://mtc-coordinator.mtc-system.svc:8471"
    assert "--coordinator-ca" not in agent
    coordinator = _container(rendered[("Deployment", "mtc-coordinator")], "mtc-coordinator")
    assert "--tls-cert" not in _argv(coordinator)
    assert coordinator["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert _flag(_argv(coordinator), "--token-file") == "/etc/mtc/peer-token/token"  # the token stays required
    assert ("Secret", "mtc-tls") not in rendered
