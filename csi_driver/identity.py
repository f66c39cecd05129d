"""CSI Identity service: plugin name, version, capabilities and readiness."""

import importlib.metadata
import os
from collections.abc import Callable

import grpc

from protos import csi_pb2, csi_pb2_grpc

DEFAULT_DRIVER_NAME = "ramdisk.csi.mtc.dev"
DISTRIBUTION = "mtc-checkpointing"


def version() -> str:
    """The installed distribution's version; from a source tree that is not installed, ``pyproject.toml``'s."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
    try:
        import tomllib  # Python 3.11 on; the agent's image has it

        with open(pyproject, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (ImportError, OSError, KeyError, ValueError):
        return "unknown"


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
        return csi_pb2.GetPluginInfoResponse(name=self._driver_name, vendor_version=version())

    def GetPluginCapabilities(self, request, context):
        # No CONTROLLER_SERVICE: this is a node-only driver for ephemeral inline volumes.
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    def Probe(self, request, context: grpc.ServicerContext):
        return csi_pb2.ProbeResponse(ready={"value": self._ready()})
