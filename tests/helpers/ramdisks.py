"""Volume requests for ``RamdiskManager`` tests, as kubelet's publish would carry them, and small real tmpfs mounts."""

import contextlib
import os
import subprocess
from collections.abc import Iterator

from csi_driver.ramdisk import Ramdisk
from csi_driver.volume_request import VolumeSpec, parse_volume_context
from examples.local_cluster import unmount_all_below


def spec(job: str = "train", pod: str = "p", size: int = 8 << 20, **extra) -> VolumeSpec:
    """The parsed volume context of pod ``pod`` of ``job``; ``extra`` adds attributes."""
    context = {"csi.storage.k8s.io/pod.name": pod, "job": job, "size": str(size), **extra}
    return parse_volume_context(context, default_size_bytes=1 << 20)


def ignore_new_pod(disk: Ramdisk, spec: VolumeSpec) -> None:
    """The publish hook of tests about the ramdisks themselves (the hook has its own test)."""


@contextlib.contextmanager
def small_tmpfs(path: str, size: str) -> Iterator[str]:
    """A real tmpfs of ``size`` (``mount -o size=``, e.g. ``2M``) mounted at ``path``; always unmounted."""
    os.mkdir(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "mtc-test-small", path], check=True)
    try:
        yield path
    finally:
        unmount_all_below(path)
