"""What the API server says, laid over what a node reports: its pods' shape and ranks, rank 0's address, and the
node's failure domains.

With ``mtc coordinator --kube``, ``kube_watch.ShapeWatcher`` keeps every JobSet job's shape, and each node report is
passed through ``KubeOverlay.apply`` before the cluster state takes it in:

- a pod the shape places, once the API server has its IP, gets the shape's ``nodes`` and ``slices``, its slice (the
  JobSet job index, offset for several replicatedJobs) and worker (the Job completion index), and its ``address``:
  the pod IP, as the managed product's ``jax-init-info.txt`` holds. Its volume's attributes do not matter then (a
  contradiction was refused by the shape). Until the IP is known the pod waits: the kubelet mounts volumes before it
  creates the pod's sandbox, so the IP follows the publish by moments, and the job's container cannot start before
  it anyway; an assignment made without it would fix an address (the DNS name) that resolves only once the pod is
  ready, or not at all without cluster DNS;
- a pod the shape does not place waits, unassigned, when its volume sets no ``nodes`` (a JobSet pod not yet seen,
  or refused: the watcher logs the pod and the field); a pod whose volume sets ``nodes`` keeps its attributes (a
  pod outside any JobSet);
- the node's topology comes from its Node labels (zone, node pool, the block label), unless the agent's own
  ``--topology`` sets a ``block``, which overrides.

The overlay is pure and synchronous: the shapes it reads are the watcher's last, which stand through an API-server
outage, so an outage changes nothing here.
"""

import logging

import msgspec

from replicator.coordinator.kube_shape import FailureDomains, JobShape, PodPlace, Shapes
from replicator.wire.messages import JobRef, NodeReport

log = logging.getLogger(__name__)

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
        self._told_waiting: set[str] = set()
        self.version = 0

    def update(self, shapes: Shapes) -> set[JobRef]:
        """Takes the watcher's new shapes; returns the jobs whose shape changed (their long polls are woken)."""
        changed = {
            key
            for key in shapes.jobs.keys() | self._shapes.jobs.keys()
            if shapes.jobs.get(key) != self._shapes.jobs.get(key)
        }
        self._shapes = shapes
        self._placed = {place.uid: (shape, place) for shape in shapes.jobs.values() for place in shape.pods}
        self._told_waiting -= {uid for uid, (_, place) in self._placed.items() if place.ip}
        self.version += 1
        return changed

    def apply(self, report: NodeReport) -> NodeReport:
        """``report`` as the API server's shapes say (see the module docstring)."""
        pods = []
        for pod in report.pods:
            found = self._placed.get(pod.pod_uid)
            if found is not None and found[1].ip:
                shape, place = found
                pods.append(
                    msgspec.structs.replace(
                        pod,
                        nodes=shape.nodes,
                        slices=shape.slices,
                        slice_index=place.slice,
                        worker_index=place.worker,
                        address=place.ip,
                    )
                )
            elif found is None and pod.nodes_given:
                pods.append(msgspec.structs.replace(pod, address=None))
            elif pod.pod_uid not in self._told_waiting:
                self._told_waiting.add(pod.pod_uid)
                why = (
                    "its pod IP" if found else "its job's shape (its volume sets no nodes and no JobSet places it yet)"
                )
                log.info(
                    "pod %s/%s (node %s) waits for %s from the API server",
                    pod.namespace,
                    pod.pod_name,
                    report.node_id,
                    why,
                )
        topology = report.topology
        if not topology.get(BLOCK) and (domains := self._shapes.domains.get(report.node_id)) is not None:
            topology = topology_of(domains)
        if pods == list(report.pods) and topology is report.topology:
            return report
        return msgspec.structs.replace(report, pods=tuple(pods), topology=topology)
