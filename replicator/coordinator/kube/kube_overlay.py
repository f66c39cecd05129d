"""What the API server says, laid over what a node reports: which of its pods it may speak for, their job, shape
and ranks, rank 0's address, and the node's failure domains.

With ``mtc coordinator --kube``, ``kube_watch.ShapeWatcher`` keeps every JobSet job's shape, and each node report is
passed through ``KubeOverlay.apply`` before the cluster state takes it in. A node speaks only for pods that the API
server places on it (as the Node authorizer lets a kubelet act only for pods bound to its node):

- a pod the shape places on the reporting node (matched by UID against ``spec.nodeName``), once the API server has
  its IP, takes the API server's namespace, job, pod name, the shape's ``nodes`` and ``slices``, its slice (the
  JobSet job index, offset for several replicatedJobs) and worker (the Job completion index), and its ``address``:
  the pod IP, as the managed product's ``jax-init-info.txt`` holds. What the node said of these does not matter (a
  volume attribute contradicting the API server was refused by the shape). Until the IP is known the pod waits: the
  kubelet mounts volumes before it creates the pod's sandbox, so the IP follows the publish by moments, and the
  job's container cannot start before it anyway; an assignment made without it would fix an address (the DNS name)
  that resolves only once the pod is ready, or not at all without cluster DNS;
- a pod the shape places on another node (or on none yet) is left out of the report, logged once: a node listing
  it is lying, or the API server has not yet told the watcher where the pod runs;
- a pod the shape does not place waits, left out of the report, whatever its volume sets (a JobSet pod not yet
  seen, or refused: the watcher logs the pod and the field; a pod outside any JobSet is never served with
  ``--kube``): so a node cannot invent a pod, of any job and any shape;
- the node's topology comes from its Node labels (zone, node pool, the block label), unless the agent's own
  ``--topology`` sets a ``block``, which overrides.

The overlay is pure and synchronous: the shapes it reads are the watcher's last, which stand through an API-server
outage, so an outage changes nothing here.
"""

import logging

import msgspec

from replicator.coordinator.kube.kube_shape import FailureDomains, JobShape, PodPlace, Shapes
from replicator.wire.messages import JobRef, NodeReport, PodReport

log = logging.getLogger(__name__)

MAX_TOLD = 100_000
"""Pods whose wait is remembered as logged, at most: a node listing invented UIDs cannot grow it without bound."""

BLOCK = "block"
"""The topology key the replica planner groups close peers by (``planner.place_replicas``)."""


def topology_of(domains: FailureDomains) -> dict[str, str]:
    """A node's topology labels from its failure domains; ``block`` is the finest domain known (block or rack,
    else node pool, else zone), so close peers share the smallest domain the cluster names."""
    labels = {name: value for name, value in (("zone", domains.zone), ("nodepool", domains.nodepool)) if value}
    if finest := domains.block or domains.nodepool or domains.zone:
        labels[BLOCK] = finest
    return labels


class KubeOverlay:
    """Rewrites node reports with the API server's shapes (see the module docstring).

    Attributes:
      version: bumped by every ``update``, so a held long poll knows to apply its report again.
    """

    def __init__(self) -> None:
        self._placed: dict[str, tuple[JobShape, PodPlace]] = {}
        self._shapes = Shapes({}, ())
        self._told: set[tuple[str, str]] = set()  # (pod uid, why) logged once; bounded by MAX_TOLD
        self.version = 0

    @property
    def shapes(self) -> Shapes:
        """The watcher's last shapes."""
        return self._shapes

    def update(self, shapes: Shapes) -> set[JobRef]:
        """Takes the watcher's new shapes; returns the jobs whose shape changed (their long polls are woken)."""
        changed = {
            key
            for key in shapes.jobs.keys() | self._shapes.jobs.keys()
            if shapes.jobs.get(key) != self._shapes.jobs.get(key)
        }
        self._shapes = shapes
        self._placed = {place.uid: (shape, place) for shape in shapes.jobs.values() for place in shape.pods}
        # A wait logged is logged again if the pod waits again after it ended (a lie is logged once).
        self._told = {(uid, why) for uid, why in self._told if why.startswith("on ") or not self._served(uid)}
        self.version += 1
        return changed

    def apply(self, report: NodeReport) -> NodeReport:
        """``report`` as the API server's shapes say: only the pods placed on the report's node, as placed (see the
        module docstring)."""
        pods = []
        for pod in report.pods:
            found = self._placed.get(pod.pod_uid)
            if found is not None and found[1].ip and found[1].node == report.node_id:
                shape, place = found
                pods.append(
                    msgspec.structs.replace(
                        pod,
                        namespace=shape.job.namespace,
                        job=shape.job.job,
                        pod_name=place.name,
                        nodes=shape.nodes,
                        slices=shape.slices,
                        slice_index=place.slice,
                        worker_index=place.worker,
                        address=place.ip,
                    )
                )
            else:
                self._tell(report.node_id, pod)
        topology = report.topology
        if not topology.get(BLOCK) and (domains := self._shapes.domains.get(report.node_id)) is not None:
            topology = topology_of(domains)
        if pods == list(report.pods) and topology is report.topology:
            return report
        return msgspec.structs.replace(report, pods=tuple(pods), topology=topology)

    def _served(self, uid: str) -> bool:
        found = self._placed.get(uid)
        return found is not None and found[1].ip is not None

    def _tell(self, node_id: str, pod: PodReport) -> None:
        """Logs, once per pod and reason, why ``node_id``'s pod is left out of its report."""
        found = self._placed.get(pod.pod_uid)
        place = found[1] if found is not None else None
        elsewhere = place is not None and place.node is not None and place.node != node_id
        why = "unplaced" if place is None else f"on {place.node}" if elsewhere else "no ip"
        if (pod.pod_uid, why) in self._told:
            return
        if len(self._told) >= MAX_TOLD:
            self._told.clear()  # at worst, a waiting pod is logged again
        self._told.add((pod.pod_uid, why))
        if place is not None and elsewhere:
            log.warning(
                "node %s lists pod %s (uid %s) that the API server places on node %s: ignored",
                node_id,
                place.name,
                pod.pod_uid,
                place.node,
            )
        else:
            log.info(
                "pod %s/%s (uid %s, node %s) waits for %s from the API server",
                pod.namespace,
                pod.pod_name,
                pod.pod_uid,
                node_id,
                "its place (a JobSet pod not yet seen, or refused; with --kube only JobSet pods are served)"
                if place is None
                else "its node and pod IP",
            )
