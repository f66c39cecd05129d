"""A JobSet whose pods the API server places on chosen Node objects with no kubelet, for the suites that check that a
node speaks only for the pods placed on it (issue 48).

The real JobSet and Job controllers make the pods and the real scheduler binds them, one to each chosen node (a node
selector picks the nodes, anti-affinity spreads the pods); then the test writes each pod's status as a kubelet would
(Running, the pod IP given for its node), since the coordinator serves a pod only once it has an IP.
"""

import contextlib
import dataclasses
from collections.abc import Iterator

from lightkube import ApiError, Client, codecs
from lightkube.resources.core_v1 import Pod

from replicator.coordinator.kube.kube_shape import COMPLETION_INDEX, DRIVER, JOBSET_NAME
from replicator.coordinator.kube.kube_watch import JobSet
from tests.helpers.kube.workloads import NO_PULL_IMAGE, jobset
from tests.helpers.kube_objects import replicated as replicated_of
from tests.helpers.polling import wait_until

WAIT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class PlacedPod:
    """A pod as the API server has it: its name, UID, node, worker index (its Job completion index) and IP."""

    name: str
    uid: str
    node: str
    worker: int
    ip: str


def _jobset(name: str, replicated: str, pods: int, node_selector: dict[str, str]) -> dict:
    """One slice of ``pods`` workers mounting our volume, one per node that ``node_selector`` picks."""
    pod_spec = {
        "restartPolicy": "Never",
        "nodeSelector": node_selector,
        "tolerations": [{"operator": "Exists"}],
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {JOBSET_NAME: name}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        },
        "containers": [{"name": "train", "image": NO_PULL_IMAGE}],
        "volumes": [{"name": "mtc-local", "csi": {"driver": DRIVER}}],
    }
    return jobset(name, replicated_of(replicated, 1, pods, pod_spec))


def _live_pods(client: Client, namespace: str, name: str) -> list[Pod]:
    return [
        p
        for p in client.list(Pod, namespace=namespace, labels={JOBSET_NAME: name})
        if p.metadata.deletionTimestamp is None
    ]


@contextlib.contextmanager
def placed_jobset(
    client: Client, namespace: str, name: str, replicated: str, ips: dict[str, str], node_selector: dict[str, str]
) -> Iterator[list[PlacedPod]]:
    """JobSet ``name`` in ``namespace`` (job ``<name>-<replicated>``, one slice) with a pod on each node of
    ``ips``, given that node's IP once bound; its pods by worker. Deleted after, its pods confirmed gone as a kubelet
    would (grace period 0).

    Args:
      ips: node -> the pod IP to give its pod.
      node_selector: labels that select exactly the nodes of ``ips``.
    """
    client.create(codecs.from_dict(_jobset(name, replicated, len(ips), node_selector)), namespace=namespace)
    try:

        def bound() -> bool:
            pods = _live_pods(client, namespace, name)
            return len(pods) == len(ips) and all(p.spec.nodeName for p in pods)

        wait_until(bound, WAIT_SECONDS, f"the pods of JobSet {namespace}/{name} bound", interval=0.2)
        placed = []
        for pod in _live_pods(client, namespace, name):
            node = pod.spec.nodeName
            assert node in ips, f"{pod.metadata.name} bound to {node}, not one of {sorted(ips)}"
            status = {"phase": "Running", "hostIP": ips[node], "podIP": ips[node], "podIPs": [{"ip": ips[node]}]}
            client.patch(Pod.Status, pod.metadata.name, {"status": status}, namespace=namespace)
            worker = int(pod.metadata.annotations[COMPLETION_INDEX])
            placed.append(PlacedPod(pod.metadata.name, pod.metadata.uid, node, worker, ips[node]))
        yield sorted(placed, key=lambda p: p.worker)
    finally:
        client.delete(JobSet, name, namespace=namespace)

        def gone() -> bool:
            pods = list(client.list(Pod, namespace=namespace, labels={JOBSET_NAME: name}))
            for pod in pods:  # the Job controller may make one more meanwhile; its finalizer goes with the Job
                with contextlib.suppress(ApiError):
                    client.delete(Pod, pod.metadata.name, namespace=namespace, grace_period=0)
            return not pods

        wait_until(gone, WAIT_SECONDS, f"the pods of JobSet {namespace}/{name} gone", interval=0.5)
