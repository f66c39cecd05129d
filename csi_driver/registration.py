"""The kubelet's plugin registration (``pluginregistration/v1``): what node-driver-registrar does, in-process.

The kubelet watches its ``plugins_registry`` directory for sockets. On ours it calls ``GetInfo`` (a CSI plugin, its
name, the CSI socket to dial, the CSI versions it speaks), registers the driver (calling ``NodeGetInfo`` on the CSI
socket and writing the node's CSINode), then reports the outcome with ``NotifyRegistrationStatus``. Removing the
socket unregisters the driver.
"""

import concurrent.futures
import logging
import os
import threading

import grpc

from csi_driver.server import remove_stale_socket, socket_path
from protos import pluginregistration_pb2, pluginregistration_pb2_grpc

log = logging.getLogger(__name__)

CSI_PLUGIN_TYPE = "CSIPlugin"
SUPPORTED_VERSIONS = ("1.0.0",)


def registration_socket(registration_dir: str, driver_name: str) -> str:
    """The socket the kubelet finds us by: ``<dir>/<driver name>-reg.sock``, node-driver-registrar's name."""
    return os.path.join(registration_dir, f"{driver_name}-reg.sock")


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):
    """Tells the kubelet where our CSI socket is, and records what it answers.

    Args:
      driver_name: the CSI driver name (the CSIDriver object's name, ``GetPluginInfo``'s).
      csi_endpoint: the CSI socket as ``unix:///path``; the kubelet is given the path.

    Raises:
      ValueError: ``csi_endpoint`` is not a ``unix:///path`` URL.
    """

    def __init__(self, driver_name: str, csi_endpoint: str):
        self.driver_name = driver_name
        self._info = pluginregistration_pb2.PluginInfo(
            type=CSI_PLUGIN_TYPE,
            name=driver_name,
            endpoint=socket_path(csi_endpoint),
            supported_versions=SUPPORTED_VERSIONS,
        )
        self.registered = threading.Event()
        self.error: str | None = None

    def GetInfo(self, request, context):
        log.info("kubelet asked for plugin info: %s %s at %s", self._info.type, self._info.name, self._info.endpoint)
        return self._info

    def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            self.error = None
            self.registered.set()
            log.info("kubelet registered CSI driver %s (socket %s)", self._info.name, self._info.endpoint)
        else:
            self.error = request.error or "no reason given"
            self.registered.clear()
            log.error(
                "kubelet REFUSED to register CSI driver %s (socket %s): %s",
                self._info.name,
                self._info.endpoint,
                self.error,
            )
        return pluginregistration_pb2.RegistrationStatusResponse()


class RegistrationServer:
    """The registration service on its socket in the kubelet's ``plugins_registry`` directory.

    Args:
      registration_dir: the kubelet's ``plugins_registry`` (``<kubelet root dir>/plugins_registry``).
      servicer: what it answers.
    """

    def __init__(self, registration_dir: str, servicer: RegistrationServicer):
        self.path = registration_socket(registration_dir, servicer.driver_name)
        self.servicer = servicer
        self._server: grpc.Server | None = None

    def start(self) -> "RegistrationServer":
        """Serves on ``path`` (replacing a socket left by a killed predecessor).

        Raises:
          RuntimeError: another process serves there, or the path is not a socket.
        """
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        remove_stale_socket(self.path)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="registration"))
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(self.servicer, server)
        server.add_insecure_port("unix://" + self.path)
        server.start()
        self._server = server
        log.info("kubelet registration socket %s", self.path)
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving and removes the socket: the kubelet unregisters the driver until the next start."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
