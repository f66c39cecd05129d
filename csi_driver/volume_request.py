"""Turns a pod's inline-volume request (``volume_context``) into a validated ``VolumeSpec``.

Kubelet fills ``csi.storage.k8s.io/*`` keys because the CSIDriver sets ``podInfoOnMount: true``;
the rest are the pod spec's ``volumeAttributes``.
"""

import dataclasses
import re
from typing import overload

from csi_driver.quantity import parse_quantity

POD_NAME_KEY = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE_KEY = "csi.storage.k8s.io/pod.namespace"
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT_KEY = "csi.storage.k8s.io/serviceAccount.name"
EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"

DEFAULT_JAX_COORDINATOR_PORT = 8476
DEFAULT_FRAMEWORK = "orbax"

# JobSet pods are named <jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<suffix>.
_JOBSET_POD_NAME = re.compile(
    r"(?P<job>[a-z0-9-]+?)-(?P<slice>[0-9]{1,9})-(?P<worker>[0-9]{1,9})-(?P<suffix>[a-z0-9]+)", re.ASCII
)
_ASCII_INT = re.compile(r"[0-9]{1,9}", re.ASCII)
DEFAULT_MAX_NODES = 100_000
# Kubernetes names of namespaces and jobs; shared by everything that builds a path from one.
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class VolumeLimits:
    """Upper bounds a request is checked against before anything is computed from it.

    Attributes:
      max_nodes: the largest ``nodes`` accepted (``--max-nodes``).
      max_size_bytes: the largest ``size`` accepted: the node's memory, bytes.
      frameworks: the ``framework`` names accepted: those the node agent serves.
    """

    max_nodes: int = DEFAULT_MAX_NODES
    max_size_bytes: int = 1 << 62
    frameworks: frozenset[str] = frozenset({DEFAULT_FRAMEWORK})


class InvalidVolumeRequest(ValueError):
    """The request cannot be served as asked; the message names the attribute and value."""


@dataclasses.dataclass(frozen=True)
class VolumeSpec:
    """What one pod asks of the node's ramdisk.

    Attributes:
      namespace: the pod's namespace (a DNS-1123 label).
      job: the training job; one ramdisk per (namespace, job) on a node (a DNS-1123 label).
      pod_name: the pod's name.
      pod_uid: the pod's UID (new for every incarnation of the pod).
      size_bytes: the ramdisk size, bytes.
      nodes: the job's node count (processes), or None when not given.
      slices: the number of slices (data-parallel replicas of the model), >= 1.
      slice_index: the pod's slice (JobSet job index), or None when unknown.
      worker_index: the pod's index within its slice (JobSet pod index), or None when unknown.
      jax_coordinator_port: the port rank 0 listens on for ``jax.distributed``.
      subdomain: the JobSet name, the DNS subdomain pods are reachable under
        (``<pod name without suffix>.<subdomain>``).
      framework: the training framework whose files the job writes in the client dir.
    """

    namespace: str
    job: str
    pod_name: str
    pod_uid: str
    size_bytes: int
    nodes: int | None
    slices: int
    slice_index: int | None
    worker_index: int | None
    jax_coordinator_port: int
    subdomain: str
    framework: str = DEFAULT_FRAMEWORK


def _dns_label(name: str, value: str) -> str:
    if not DNS1123_LABEL.match(value):
        raise InvalidVolumeRequest(
            f"{name} {value!r} is not a DNS-1123 label (lowercase a-z, 0-9, '-', at most 63 characters)"
        )
    return value


@overload
def _integer(context: dict[str, str], name: str, default: int, minimum: int, maximum: int) -> int: ...


@overload
def _integer(context: dict[str, str], name: str, default: int | None, minimum: int, maximum: int) -> int | None: ...


def _integer(context: dict[str, str], name: str, default: int | None, minimum: int, maximum: int) -> int | None:
    raw = context.get(name)
    if raw is None:
        return default
    if not _ASCII_INT.fullmatch(raw):  # int() would also take " 3", "1_000" and non-ASCII digits
        raise InvalidVolumeRequest(f"volume attribute {name}={raw[:32]!r} is not an integer of at most 9 ASCII digits")
    value = int(raw)
    if not minimum <= value <= maximum:
        raise InvalidVolumeRequest(f"volume attribute {name}={raw!r} must be between {minimum} and {maximum}")
    return value


def _size_bytes(raw_size: str | None, default_size_bytes: int, limits: VolumeLimits) -> int:
    """The ``size`` attribute in bytes (``default_size_bytes`` when absent); raises InvalidVolumeRequest."""
    try:
        size_bytes = default_size_bytes if raw_size is None else parse_quantity(raw_size)
    except ValueError as err:
        raise InvalidVolumeRequest(f"volume attribute size: {err}") from None
    if not 0 < size_bytes <= limits.max_size_bytes:
        raise InvalidVolumeRequest(
            f"volume attribute size={raw_size!r} must be positive and at most the node's memory ({limits.max_size_bytes} bytes)"
        )
    return size_bytes


def _framework(framework: str, limits: VolumeLimits) -> str:
    """The ``framework`` attribute, one ``limits`` serves; raises InvalidVolumeRequest."""
    if framework not in limits.frameworks:
        raise InvalidVolumeRequest(
            f"volume attribute framework={framework[:64]!r} is not served here: use one of {', '.join(sorted(limits.frameworks))}"
        )
    return framework


def parse_volume_context(
    context: dict[str, str], default_size_bytes: int, limits: VolumeLimits = VolumeLimits()
) -> VolumeSpec:
    """Validates a ``NodePublishVolume`` ``volume_context``.

    Args:
      context: kubelet's pod-info keys plus the pod's ``volumeAttributes``: ``job`` (optional for
        JobSet pod names), ``nodes``, ``slices`` (default 1), ``size`` (a Kubernetes quantity),
        ``jaxCoordinatorPort`` (default 8476), ``framework`` (default ``orbax``), and optionally
        ``slice`` / ``worker`` and ``jobset`` (the DNS subdomain; default ``job``).
      default_size_bytes: the size used when ``size`` is absent, bytes.
      limits: bounds on ``nodes`` and ``size``, the frameworks served.

    Returns:
      The validated ``VolumeSpec``.

    Raises:
      InvalidVolumeRequest: an attribute is missing, unparsable or unsafe; the message names it.
    """
    pod_name = context.get(POD_NAME_KEY, "")
    if not pod_name:
        raise InvalidVolumeRequest(f"volume_context lacks {POD_NAME_KEY}: set podInfoOnMount: true on the CSIDriver")
    namespace = _dns_label("namespace", context.get(POD_NAMESPACE_KEY, "default"))
    jobset_name = _JOBSET_POD_NAME.fullmatch(pod_name)
    job = context.get("job") or (jobset_name["job"] if jobset_name else "")
    if not job:
        raise InvalidVolumeRequest(
            f"volume attribute job is missing and pod name {pod_name!r} does not follow JobSet naming "
            "<jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<suffix>"
        )
    _dns_label("job", job)
    size_bytes = _size_bytes(context.get("size"), default_size_bytes, limits)
    nodes = _integer(context, "nodes", None, minimum=1, maximum=limits.max_nodes)
    slices = _integer(context, "slices", 1, minimum=1, maximum=nodes or limits.max_nodes)
    if nodes is not None and nodes % slices:
        raise InvalidVolumeRequest(f"volume attribute nodes={nodes} is not a multiple of slices={slices}")
    default_slice = int(jobset_name["slice"]) if jobset_name else None
    default_worker = int(jobset_name["worker"]) if jobset_name else None
    port = _integer(context, "jaxCoordinatorPort", DEFAULT_JAX_COORDINATOR_PORT, minimum=1, maximum=65535)
    framework = _framework(context.get("framework", DEFAULT_FRAMEWORK), limits)
    return VolumeSpec(
        namespace=namespace,
        job=job,
        pod_name=pod_name,
        pod_uid=context.get(POD_UID_KEY, ""),
        size_bytes=size_bytes,
        nodes=nodes,
        slices=slices,
        slice_index=_integer(context, "slice", default_slice, minimum=0, maximum=limits.max_nodes),
        worker_index=_integer(context, "worker", default_worker, minimum=0, maximum=limits.max_nodes),
        jax_coordinator_port=port,
        subdomain=_dns_label("jobset", context.get("jobset") or job),
        framework=framework,
    )
