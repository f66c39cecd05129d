"""The CSI gRPC server on a unix socket."""

import concurrent.futures
import logging
import os
import socket
import stat

import grpc

from csi_driver.controller import ControllerServicer
from csi_driver.identity import IdentityServicer
from csi_driver.node import NodeServicer
from protos import csi_pb2_grpc

log = logging.getLogger(__name__)


def socket_path(endpoint: str) -> str:
    """Returns the filesystem path of a ``unix:///path`` CSI endpoint.

    Raises:
      ValueError: the endpoint is not a unix socket URL.
    """
    if not endpoint.startswith("unix://") or not endpoint[len("unix://") :].startswith("/"):
        raise ValueError(f"CSI endpoint {endpoint!r} must look like unix:///path/to/csi.sock")
    return endpoint[len("unix://") :]


def remove_stale_socket(path: str) -> None:
    """Removes a socket file left by a killed predecessor.

    Raises:
      RuntimeError: a live process still serves on ``path``, or ``path`` is not a socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale CSI socket %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another process is serving on {path}")


def start_csi_server(
    endpoint: str, identity: IdentityServicer, node: NodeServicer, max_workers: int = 8
) -> grpc.Server:
    """Serves Identity, Node and the Controller stub on ``endpoint``; returns the started server."""
    path = socket_path(endpoint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    remove_stale_socket(path)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)
    csi_pb2_grpc.add_NodeServicer_to_server(node, server)
    csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(), server)
    server.add_insecure_port(endpoint)
    server.start()
    log.info("CSI server listening on %s", endpoint)
    return server
