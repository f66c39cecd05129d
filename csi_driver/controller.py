"""CSI Controller service stub: a node-only driver has no controller.

csi-sanity calls ``ControllerGetCapabilities`` before every Node test and fails on an error or an
empty list, so it answers one ``RPC_UNKNOWN`` capability. Every other RPC falls through to the
generated base class, which answers UNIMPLEMENTED.
"""

from protos import csi_pb2, csi_pb2_grpc

_UNKNOWN = csi_pb2.ControllerServiceCapability.RPC.UNKNOWN


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    """Advertises no controller capability beyond ``RPC_UNKNOWN``."""

    def ControllerGetCapabilities(self, request, context):
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[csi_pb2.ControllerServiceCapability(rpc={"type": _UNKNOWN})]
        )
