"""A kubelet stand-in: ``mtc publish`` / ``mtc unpublish`` call the node plugin as kubelet would.

There is no kubelet on a workstation or in tests; this is the named substitute for it. Requests
carry the same ``volume_context`` keys kubelet adds with ``podInfoOnMount: true`` and a
kubelet-style ``volume_id`` (``"csi-" + sha256(podUID + volumeName)``).
"""

import hashlib
import os
import uuid

import grpc

from csi_driver import volume_request
from protos import csi_pb2, csi_pb2_grpc


def kubelet_volume_id(pod_uid: str, volume_name: str) -> str:
    """The id kubelet gives an ephemeral inline volume: new for every pod."""
    return "csi-" + hashlib.sha256((pod_uid + volume_name).encode()).hexdigest()


def _node_stub(endpoint: str) -> tuple[grpc.Channel, csi_pb2_grpc.NodeStub]:
    channel = grpc.insecure_channel(endpoint)
    return channel, csi_pb2_grpc.NodeStub(channel)


def publish(
    endpoint: str,
    target: str,
    pod: str,
    namespace: str = "default",
    pod_uid: str | None = None,
    volume_id: str | None = None,
    attributes: dict[str, str] | None = None,
    volume_name: str = "ramdisk",
    timeout: float = 60.0,
) -> str:
    """Calls ``NodePublishVolume`` for an inline volume of pod ``pod``.

    Args:
      endpoint: the plugin's CSI endpoint, ``unix:///path``.
      target: the target path; its parent is created as kubelet would.
      pod, namespace, pod_uid: the pod; a random UID stands in when none is given.
      volume_id: defaults to the kubelet-style id derived from pod UID and volume name.
      attributes: the pod spec's ``volumeAttributes`` (``job``, ``nodes``, ``size``, ...).
      timeout: seconds.

    Returns:
      The volume_id used (needed to unpublish).

    Raises:
      grpc.RpcError: the plugin refused; ``.code()`` and ``.details()`` say why.
    """
    pod_uid = pod_uid or str(uuid.uuid4())
    volume_id = volume_id or kubelet_volume_id(pod_uid, volume_name)
    context = {
        volume_request.POD_NAME_KEY: pod,
        volume_request.POD_NAMESPACE_KEY: namespace,
        volume_request.POD_UID_KEY: pod_uid,
        volume_request.SERVICE_ACCOUNT_KEY: "default",
        volume_request.EPHEMERAL_KEY: "true",
        **(attributes or {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    channel, stub = _node_stub(endpoint)
    with channel:
        stub.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id,
                target_path=os.path.abspath(target),
                volume_capability=csi_pb2.VolumeCapability(
                    mount=csi_pb2.VolumeCapability.MountVolume(),
                    access_mode=csi_pb2.VolumeCapability.AccessMode(
                        mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
                    ),
                ),
                volume_context=context,
            ),
            timeout=timeout,
        )
    return volume_id


def unpublish(endpoint: str, target: str, volume_id: str = "unknown", timeout: float = 60.0) -> None:
    """Calls ``NodeUnpublishVolume`` for ``target``.

    Raises:
      grpc.RpcError: the plugin refused.
    """
    channel, stub = _node_stub(endpoint)
    with channel:
        stub.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=os.path.abspath(target)),
            timeout=timeout,
        )
