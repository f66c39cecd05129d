"""CSI Identity service: plugin name, capabilities and readiness."""

from collections.abc import Callable

import grpc

from protos import csi_pb2, csi_pb2_grpc

DEFAULT_DRIVER_NAME = "ramdisk.csi.mtc.dev"
DRIVER_VERSION = "0.1.0"


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    """Answers kubelet, the node-driver-registrar and the livenessprobe sidecar.

    Args:
      driver_name: the domain-style CSI driver name (``--driver-name``).
      ready: True once the agent has rebuilt its state and while its loops are not wedged;
        ``Probe`` reports it, so the livenessprobe sidecar restarts a wedged agent.
    """

    def __init__(self, driver_name: str, ready: Callable[[], bool]):
        self._driver_name = driver_name
        self._ready = ready

    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=self._driver_name, vendor_version=DRIVER_VERSION)

    def GetPluginCapabilities(self, request, context):
        # No CONTROLLER_SERVICE: this is a node-only driver for ephemeral inline volumes.
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    def Probe(self, request, context: grpc.ServicerContext):
        return csi_pb2.ProbeResponse(ready={"value": self._ready()})
