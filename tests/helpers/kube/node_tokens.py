"""Node agents' identities in a real control plane, for the per-node identity suites (issue 40): the agents'
namespace, ServiceAccount and DaemonSet on Node objects with no kubelet behind them, the coordinator's
ServiceAccount bound to ``manifests/coordinator-rbac.yaml``'s rules, and projected tokens minted with
``TokenRequest`` as the kubelet asks for them.

Each suite passes names of its own: the control plane is the session's, and a namespace being deleted
cannot be created again until the namespace controller has emptied it.
"""

import base64
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding
from lightkube import ALL_NS, ApiError, Client
from lightkube.codecs import load_all_yaml
from lightkube.models.apps_v1 import DaemonSetSpec
from lightkube.models.authentication_v1 import BoundObjectReference, TokenRequestSpec
from lightkube.models.core_v1 import Container, PodSpec, PodTemplateSpec, Toleration
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.models.rbac_v1 import RoleRef, Subject
from lightkube.resources.apps_v1 import DaemonSet
from lightkube.resources.core_v1 import Namespace, Node, Pod, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding

from replicator.coordinator.trust.node_identity import DEFAULT_AUDIENCE
from tests.helpers.kube.control_plane import ControlPlane, register_node
from tests.helpers.polling import wait_until

RBAC = Path(__file__).parents[3] / "manifests" / "coordinator-rbac.yaml"
# The agents' pods' label, the DaemonSet's and ServiceAccount's names: what ``NodeIdentitySettings`` expects.
AGENT_LABELS = {"app": "mtc-node"}
AGENT_ACCOUNT = "mtc"
AGENT_DAEMONSET = "mtc-node"


@dataclasses.dataclass(frozen=True)
class AgentCluster:
    """What ``agent_cluster`` made.

    Attributes:
      client: the control plane's admin client.
      nodes: the Node objects the agents' DaemonSet runs on.
      kubeconfig: the coordinator's kubeconfig, as its own ServiceAccount.
      trainer: a training pod of another ServiceAccount (``trainer`` of the team's namespace) on the first node.
      work: a folder of the control plane's for the suite's files.
    """

    client: Client
    nodes: tuple[str, ...]
    kubeconfig: str
    trainer: Pod
    work: Path


def mint(
    client: Client, pod: Pod, audience: str = DEFAULT_AUDIENCE, account: str = AGENT_ACCOUNT, seconds: int = 600
) -> str:
    """A token of ``account`` bound to ``pod`` (the API server adds its node), as the kubelet asks for it."""
    request = ServiceAccount.Token(
        metadata=ObjectMeta(),
        spec=TokenRequestSpec(
            audiences=[audience],
            expirationSeconds=seconds,
            boundObjectRef=BoundObjectReference(
                kind="Pod", apiVersion="v1", name=pod.metadata.name, uid=pod.metadata.uid
            ),
        ),
    )
    return client.create(request, account, namespace=pod.metadata.namespace).status.token


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def expired_copy(token: str, signing_key: Path) -> str:
    """``token`` with its lifetime moved an hour into the past, signed again with the cluster's
    service-account key: a genuine token that has expired."""
    header, payload, _ = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    shift = int(time.time()) - claims["exp"] - 3600
    for name in ("exp", "iat", "nbf"):
        claims[name] += shift
    claims["kubernetes.io"]["warnafter"] = claims["kubernetes.io"].get("warnafter", claims["iat"]) + shift
    signed = f"{header}.{_b64(json.dumps(claims).encode())}"
    key = serialization.load_pem_private_key(signing_key.read_bytes(), None)
    return f"{signed}.{_b64(key.sign(signed.encode(), padding.PKCS1v15(), hashes.SHA256()))}"  # type: ignore[union-attr]  # an RSA key


def daemonset_pod(client: Client, node: str) -> Pod:
    """The agents' DaemonSet pod bound to ``node``, once the controller made it and the scheduler bound it
    (each suite's nodes are its own, so the node names the suite's DaemonSet)."""

    def bound() -> Pod | None:
        pods = client.list(Pod, namespace=ALL_NS, labels=AGENT_LABELS)
        return next((p for p in pods if p.spec.nodeName == node and p.metadata.deletionTimestamp is None), None)

    wait_until(bound, timeout=60, what=f"the DaemonSet's pod bound to {node}", interval=0.5)
    pod = bound()
    assert pod is not None
    return pod


@contextlib.contextmanager
def agent_cluster(
    control_plane: ControlPlane,
    namespace: str,
    team: str,
    nodes: tuple[str, ...],
    label: str,
    coordinator_seconds: int = 3600,
) -> Iterator[AgentCluster]:
    """The agents' ``namespace``, ServiceAccount and DaemonSet (on the nodes labelled ``label`` only), ``nodes``
    so labelled, a training pod of namespace ``team`` on the first node, and the coordinator's ServiceAccount
    and kubeconfig; all deleted after (a node the suite deleted meanwhile is left).

    Args:
      namespace, team, nodes, label: the suite's own names (cluster-wide objects are named after ``namespace``).
      coordinator_seconds: the lifetime of the coordinator's token in its kubeconfig (nothing renews it).
    """
    client = control_plane.client()
    role_name = f"mtc-coordinator-{namespace}"
    for name in (namespace, team):
        client.create(Namespace(metadata=ObjectMeta(name=name)))
    client.create(ServiceAccount(metadata=ObjectMeta(name=AGENT_ACCOUNT, namespace=namespace)))
    client.create(ServiceAccount(metadata=ObjectMeta(name="mtc-coordinator", namespace=namespace)))
    client.create(ServiceAccount(metadata=ObjectMeta(name="trainer", namespace=team)))
    role = next(o for o in load_all_yaml(RBAC.read_text()) if isinstance(o, ClusterRole))
    role.metadata = ObjectMeta(name=role_name)
    client.create(role)
    client.create(
        ClusterRoleBinding(
            metadata=ObjectMeta(name=role_name),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="ClusterRole", name=role_name),
            subjects=[Subject(kind="ServiceAccount", name="mtc-coordinator", namespace=namespace)],
        )
    )
    for node in nodes:
        register_node(client, node, labels={label: "true"})
    client.create(
        DaemonSet(
            metadata=ObjectMeta(name=AGENT_DAEMONSET, namespace=namespace),
            spec=DaemonSetSpec(
                selector=LabelSelector(matchLabels=AGENT_LABELS),
                template=PodTemplateSpec(
                    metadata=ObjectMeta(labels=AGENT_LABELS),
                    spec=PodSpec(
                        serviceAccountName=AGENT_ACCOUNT,
                        automountServiceAccountToken=False,
                        nodeSelector={label: "true"},
                        tolerations=[Toleration(operator="Exists")],
                        containers=[Container(name="agent", image="mtc-agent:never-pulled")],
                    ),
                ),
            ),
        )
    )
    trainer = client.create(
        Pod(
            metadata=ObjectMeta(name="trainer", namespace=team),
            spec=PodSpec(
                serviceAccountName="trainer",
                nodeName=nodes[0],
                automountServiceAccountToken=False,
                containers=[Container(name="train", image="trainer:never-pulled")],
            ),
        )
    )
    work = control_plane.workdir / namespace
    work.mkdir(exist_ok=True)
    coordinator_token = client.create(
        ServiceAccount.Token(
            metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=coordinator_seconds)
        ),
        "mtc-coordinator",
        namespace=namespace,
    ).status.token
    kubeconfig = work / "coordinator.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": control_plane.url,
                            "certificate-authority": str(control_plane.ca.pair.cert),
                        },
                    }
                ],
                "users": [{"name": "coordinator", "user": {"token": coordinator_token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "coordinator"}}],
                "current-context": "c",
            }
        )
    )
    try:
        yield AgentCluster(client, nodes, str(kubeconfig), trainer, work)
    finally:
        client.delete(DaemonSet, AGENT_DAEMONSET, namespace=namespace)
        for node in nodes:
            with contextlib.suppress(ApiError):  # lost in the suite
                client.delete(Node, node)
        for name in (namespace, team):
            client.delete(Namespace, name)
        client.delete(ClusterRoleBinding, role_name)
        client.delete(ClusterRole, role_name)
