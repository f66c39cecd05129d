"""CSI Node service: a thin translation of kubelet's calls into ``RamdiskManager`` calls.

Arguments are checked first, in spec order (capability, volume id, target path), each answering
INVALID_ARGUMENT; manager errors map to one status code each.
"""

import logging
from collections.abc import Callable

import grpc

from csi_driver import ramdisk
from csi_driver.ramdisk import RamdiskManager
from csi_driver.volume_request import InvalidVolumeRequest, VolumeLimits, VolumeSpec, parse_volume_context
from protos import csi_pb2, csi_pb2_grpc

log = logging.getLogger(__name__)

_STATUS_OF = {
    ramdisk.InsufficientMemory: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ramdisk.ShrinkBelowUsage: grpc.StatusCode.FAILED_PRECONDITION,
    ramdisk.TargetInUse: grpc.StatusCode.ALREADY_EXISTS,
}
_NODE_RPC = csi_pb2.NodeServiceCapability.RPC
# Set by the kubelet when the CSIDriver asks for tokens (``tokenRequests``); never logged.
_SECRET_CONTEXT_KEYS = frozenset({"csi.storage.k8s.io/serviceAccount.tokens"})


def _loggable(volume_context: dict[str, str]) -> dict[str, str]:
    return {
        key: "<redacted>" if key in _SECRET_CONTEXT_KEYS else value for key, value in sorted(volume_context.items())
    }


def _rpc_capability(rpc_type: int) -> csi_pb2.NodeServiceCapability:
    return csi_pb2.NodeServiceCapability(rpc={"type": rpc_type})


class NodeServicer(csi_pb2_grpc.NodeServicer):
    """Publishes job ramdisks into pods.

    Args:
      manager: owns the ramdisks.
      node_id: this node's id (``--node-id``).
      topology: accessible topology segments (``--topology KEY=VALUE``).
      default_size_bytes: ramdisk size when the volume has no ``size`` attribute, bytes.
      limits: bounds on the job's ``nodes`` and the ramdisk ``size``.
      on_publish: called with (target_path, VolumeSpec) after each successful publish.
      on_unpublish: called with target_path after each successful unpublish.
      on_refused: called with (volume_context, message) when a publish is refused for its request or the node's
        ramdisks (INVALID_ARGUMENT, RESOURCE_EXHAUSTED...), before the error goes back to the kubelet; the node
        agent passes its notices' (``replicator.node.notices``), so that the refusal becomes a pod event.
    """

    def __init__(
        self,
        manager: RamdiskManager,
        node_id: str,
        topology: dict[str, str],
        default_size_bytes: int,
        limits: VolumeLimits,
        on_publish: Callable[[str, VolumeSpec], None] = lambda target, spec: None,
        on_unpublish: Callable[[str], None] = lambda target: None,
        on_refused: Callable[[dict[str, str], str], None] = lambda context, message: None,
    ):
        self._manager = manager
        self._node_id = node_id
        self._topology = topology
        self._default_size_bytes = default_size_bytes
        self._limits = limits
        self._on_publish = on_publish
        self._on_unpublish = on_unpublish
        self._on_refused = on_refused

    def NodePublishVolume(self, request, context: grpc.ServicerContext):
        if not request.HasField("volume_capability"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is required")
        if not request.volume_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required")
        if not request.target_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target_path is required")
        if request.volume_capability.HasField("block"):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "block access is not supported: the ramdisk is a filesystem"
            )
        volume_context = dict(request.volume_context)
        try:
            spec = parse_volume_context(volume_context, self._default_size_bytes, self._limits)
            self._manager.publish(request.volume_id, request.target_path, spec, readonly=request.readonly)
        except InvalidVolumeRequest as err:
            self._on_refused(volume_context, str(err))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except ramdisk.RamdiskError as err:
            self._on_refused(volume_context, str(err))
            context.abort(_STATUS_OF[type(err)], str(err))
        log.info(
            "published %s/%s for pod %s at %s, volume_context %s",
            spec.namespace,
            spec.job,
            spec.pod_name,
            request.target_path,
            _loggable(volume_context),
        )
        self._on_publish(request.target_path, spec)
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request, context: grpc.ServicerContext):
        if not request.volume_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required")
        if not request.target_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target_path is required")
        if self._manager.unpublish(request.target_path) is not None:
            log.info("unpublished %s", request.target_path)
            self._on_unpublish(request.target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def NodeGetCapabilities(self, request, context):
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[_rpc_capability(_NODE_RPC.GET_VOLUME_STATS), _rpc_capability(_NODE_RPC.VOLUME_CONDITION)]
        )

    def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(
            node_id=self._node_id,
            accessible_topology=csi_pb2.Topology(segments=self._topology) if self._topology else None,
        )

    def NodeGetVolumeStats(self, request, context: grpc.ServicerContext):
        if not request.volume_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required")
        if not request.volume_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_path is required")
        found = self._manager.find_by_target(request.volume_path)
        if found is None or found[1].volume_id != request.volume_id:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"volume {request.volume_id} is not published at {request.volume_path}"
            )
        disk = found[0]
        if not self._manager.is_healthy(disk):
            return csi_pb2.NodeGetVolumeStatsResponse(
                volume_condition={"abnormal": True, "message": f"ramdisk {disk.path} is no longer mounted"}
            )
        usage = self._manager.usage(disk)
        unit = csi_pb2.VolumeUsage.Unit
        return csi_pb2.NodeGetVolumeStatsResponse(
            usage=[
                csi_pb2.VolumeUsage(
                    unit=unit.BYTES, total=usage.total_bytes, used=usage.used_bytes, available=usage.available_bytes
                ),
                csi_pb2.VolumeUsage(
                    unit=unit.INODES, total=usage.total_inodes, used=usage.used_inodes, available=usage.available_inodes
                ),
            ],
            volume_condition={"abnormal": False, "message": "ramdisk mounted"},
        )
