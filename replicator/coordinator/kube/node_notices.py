"""A node agent's notices (``NodeReport.notices``) as Kubernetes Warning events (``--kube``).

The agents hold no API credentials: what a node sees for its operator (a volume refused, a ramdisk full, the backup
store unusable) rides on its report, and the coordinator records it through ``kube_events.EventRecorder`` (client-go's
correlation, so a repeat bumps a count). A notice is a node's word, so it is taken as untrusted input:

- only the reasons of ``NOTICE_REASONS``, type Warning, whatever else the node says (the sizes are the wire's
  bounds: ``MAX_NOTICES`` notices of ``MAX_NOTICE_CHARS`` characters);
- a notice about a pod names it by namespace and UID; its event goes to the pod the API server's shapes place on
  the reporting node (the pod's name is the API server's), and nowhere if none does: a node cannot put events on
  another node's pods, nor on a pod outside a JobSet job;
- a notice about the node goes to the Node of the report's node id, if the API server knows that Node (in
  ``default``, with the node's name as its UID, as the kubelet's own Node events, so ``kubectl describe node``
  lists it).

Every message is prefixed with the node's name.
"""

import logging

from replicator.coordinator.kube.kube_events import EventRecorder, EventType, ObjectRef
from replicator.coordinator.kube.kube_shape import Shapes
from replicator.wire.messages import NOTICE_REASONS, NodeReport, Notice

log = logging.getLogger(__name__)


def object_of(node_id: str, notice: Notice, shapes: Shapes) -> ObjectRef | None:
    """The object ``notice`` of node ``node_id`` is about, by the API server's ``shapes``, or None (see the module
    docstring)."""
    if notice.pod_uid is None:
        return ObjectRef("Node", "v1", "", node_id, node_id) if node_id in shapes.domains else None
    for shape in shapes.jobs.values():
        if shape.job.namespace != notice.namespace:
            continue
        for place in shape.pods:
            if place.uid == notice.pod_uid:
                return (
                    ObjectRef("Pod", "v1", notice.namespace, place.name, place.uid) if place.node == node_id else None
                )
    return None


class NoticeEvents:
    """Records each report's notices as events (``take``)."""

    def __init__(self, recorder: EventRecorder):
        self._recorder = recorder

    def take(self, report: NodeReport, shapes: Shapes) -> None:
        """Records the events of ``report``'s notices on their objects in ``shapes``; drops the rest with a debug
        line (a pod not placed yet, or a node's lie)."""
        for notice in report.notices:
            ref = object_of(report.node_id, notice, shapes) if notice.reason in NOTICE_REASONS else None
            if ref is None:
                log.debug("notice %s of node %s names no object it may: dropped", notice.reason, report.node_id)
                continue
            self._recorder.record(ref, EventType.WARNING, notice.reason, f"node {report.node_id}: {notice.message}")
