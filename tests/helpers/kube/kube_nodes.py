"""A control plane of its own whose Nodes are a ``LocalCluster``'s node agents, kept as a cluster keeps them over a
long run, for per-node identity (issue 40) under the chaos suite's ``kube`` variant (``tests/drivers/chaos.py``).

``KubeNodes`` starts a ``ControlPlane`` and ``agent_cluster``'s objects (the agents' namespace, ServiceAccount and
DaemonSet, the coordinator's ServiceAccount and kubeconfig), then does a kubelet's part for each Node, none of which
runs a kubelet (``register_node``):
- a Node joins with its rack label; the DaemonSet controller makes the agents' pod on it and the scheduler binds it;
- the agent's projected token is minted with ``TokenRequest`` for that pod and written as the kubelet projects it
  (``project_secret``), and minted again at 80% of its lifetime, as the kubelet rotates it;
- its Lease in ``kube-node-lease`` is renewed, so the node lifecycle controller keeps it Ready past its grace period;
- a lost node's Node (and Lease) is deleted, as the cloud's node controller does.

The training JobSets it creates (``jobset``) are the README's example with the run's JAX port and ramdisk size, in
namespace ``default``; ``JobSetJob`` runs their pods on the agents.
"""

import contextlib
import datetime
import os
import threading
import time

import httpx2
from lightkube import ApiError, Client, codecs
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Node

from replicator.coordinator.kube.kube_shape import DEFAULT_BLOCK_LABEL
from replicator.coordinator.kube.kube_watch import JobSet  # registers the kind with lightkube's codecs
from tests.helpers.kube.control_plane import ControlPlane, register_node
from tests.helpers.kube.node_tokens import agent_cluster, daemonset_pod, mint
from tests.helpers.kube.workloads import example_jobset
from tests.helpers.secrets import project_secret

AGENT_NAMESPACE, TEAM, LABEL = "mtc-system", "mtc-team", "mtc.dev/agent-node"
JOB_NAMESPACE = "default"
TOKEN_SECONDS = 600  # the chart's nodeIdentity expiry; TokenRequest's shortest
ROTATE_AFTER = 0.8 * TOKEN_SECONDS  # the kubelet mints a new token once 80% of its lifetime has passed
HEARTBEAT_SECONDS = 30.0
COORDINATOR_SECONDS = 24 * 3600  # the coordinator's kubeconfig token: longer than any run
_LEASES = "kube-node-lease"
_FIELD_MANAGER = "mtc-stand-in-kubelet"


class KubeNodes:
    """The control plane and its Nodes (see the module docstring); a context manager that stops them.

    Attributes:
      plane: the control plane.
      client: its admin client (the caller's thread's; the renewals use their own).
      kubeconfig: the coordinator's kubeconfig, as its own ServiceAccount bound to ``manifests/coordinator-rbac.yaml``.
      namespace: the agents' DaemonSet's namespace (the coordinator's ``--agent-namespace``).
      rotations: tokens minted again as their lifetime ran out, so far.
    """

    namespace = AGENT_NAMESPACE

    def __init__(self, workdir: str, racks: dict[str, str]):
        """Starts the control plane with Nodes ``racks``' keys, each labelled with its rack (``DEFAULT_BLOCK_LABEL``).

        Raises:
          FileNotFoundError: a control-plane binary is missing (``make k8s-tools``).
        """
        self._workdir = workdir
        self._tokens: dict[str, float] = {}  # node -> when its agent's token was minted (monotonic)
        self.rotations = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stack = contextlib.ExitStack()
        try:
            self.plane = self._stack.enter_context(ControlPlane())
            made = self._stack.enter_context(
                agent_cluster(self.plane, AGENT_NAMESPACE, TEAM, tuple(racks), LABEL, COORDINATOR_SECONDS)
            )
        except BaseException:
            self._stack.close()
            raise
        self.client, self.kubeconfig = made.client, made.kubeconfig
        for node, rack in racks.items():
            self.client.patch(Node, node, {"metadata": {"labels": {DEFAULT_BLOCK_LABEL: rack}}})
        self._renewals = threading.Thread(target=self._renew, name="stand-in kubelets", daemon=True)
        self._renewals.start()

    def __enter__(self) -> "KubeNodes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops the renewals, deletes the objects made, stops the control plane."""
        self._stop.set()
        self._renewals.join()
        self._stack.close()

    def join(self, node: str, rack: str) -> None:
        """A fresh Node ``node`` in ``rack``, where the agents' DaemonSet will run (``token_file`` waits for it)."""
        register_node(self.client, node, labels={LABEL: "true", DEFAULT_BLOCK_LABEL: rack})

    def lose(self, node: str) -> None:
        """Node ``node`` is gone: its Node and Lease deleted, its token no longer rotated."""
        with self._lock:
            self._tokens.pop(node, None)
        self.client.delete(Node, node)
        with contextlib.suppress(ApiError):
            self.client.delete(Lease, node, namespace=_LEASES)

    def token_file(self, node: str) -> str:
        """The path of node ``node``'s agent token (``LocalCluster``'s ``node_token``): minted for the DaemonSet's
        pod on it once that pod is bound (within 60 s), and rotated from then on.

        Raises:
          TimeoutError: no DaemonSet pod was bound to the node.
        """
        with self._lock:
            self._mint(self.client, node)
            self._tokens[node] = time.monotonic()
        return self._path(node)

    def _path(self, node: str) -> str:
        return os.path.join(self._workdir, "node-tokens", node, "token")

    def _mint(self, client: Client, node: str) -> None:
        os.makedirs(os.path.dirname(self._path(node)), exist_ok=True)
        project_secret(self._path(node), mint(client, daemonset_pod(client, node), seconds=TOKEN_SECONDS))

    def _renew(self) -> None:
        """Every ``HEARTBEAT_SECONDS``: each node's Lease renewed, and its token minted again once due. A failed
        call is printed and tried again at the next beat (the API server may be slow on a loaded machine)."""
        client = self.plane.client()
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with self._lock:
                for node, minted in list(self._tokens.items()):
                    try:
                        self._renew_lease(client, node)
                        if time.monotonic() - minted >= ROTATE_AFTER:
                            self._mint(client, node)
                            self._tokens[node], self.rotations = time.monotonic(), self.rotations + 1
                    except (ApiError, httpx2.HTTPError, TimeoutError) as err:
                        print(f"stand-in kubelet of {node}: {err}", flush=True)

    @staticmethod
    def _renew_lease(client: Client, node: str) -> None:
        lease = Lease(
            metadata=ObjectMeta(name=node, namespace=_LEASES),
            spec=LeaseSpec(holderIdentity=node, leaseDurationSeconds=40, renewTime=datetime.datetime.now(datetime.UTC)),
        )
        client.apply(lease, field_manager=_FIELD_MANAGER, force=True)

    def jobset(self, name: str, jax_port: int, size: str) -> JobSet:
        """Creates JobSet ``name`` (``default`` namespace): the README's example, its pods' ramdisks ``size`` with JAX
        on ``jax_port``, restarted without limit (the suite fails it many times)."""
        document = example_jobset()
        document["metadata"] = {"name": name, "namespace": JOB_NAMESPACE}
        document["spec"]["failurePolicy"]["maxRestarts"] = 100_000
        for replicated in document["spec"]["replicatedJobs"]:
            pod = replicated["template"]["spec"]["template"]["spec"]
            for term in pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]:
                term["labelSelector"]["matchLabels"]["jobset.sigs.k8s.io/jobset-name"] = name
            for volume in pod["volumes"]:
                volume["csi"]["volumeAttributes"] = {"size": size, "jaxCoordinatorPort": str(jax_port)}
        return self.client.create(codecs.from_dict(document))

    def delete_jobset(self, name: str) -> None:
        self.client.delete(JobSet, name, namespace=JOB_NAMESPACE)
