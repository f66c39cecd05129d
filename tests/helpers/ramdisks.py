"""Volume requests for ``RamdiskManager`` tests, as kubelet's publish would carry them."""

from csi_driver.ramdisk import Ramdisk
from csi_driver.volume_request import VolumeSpec, parse_volume_context


def spec(job: str = "train", pod: str = "p", size: int = 8 << 20, **extra) -> VolumeSpec:
    """The parsed volume context of pod ``pod`` of ``job``; ``extra`` adds attributes."""
    context = {"csi.storage.k8s.io/pod.name": pod, "job": job, "size": str(size), **extra}
    return parse_volume_context(context, default_size_bytes=1 << 20)


def ignore_new_pod(disk: Ramdisk, spec: VolumeSpec) -> None:
    """The publish hook of tests about the ramdisks themselves (the hook has its own test)."""
