"""A node as the chart meets it (``make e2e-deploy``): a ``KubeletNode`` with a filesystem view of its own, a pod
network, cluster DNS and the images built from this tree.

Several nodes run on this one machine, yet a DaemonSet names one ``kubeletDir`` for all of them. So each node's
containerd and kubelet run in a mount namespace of the node's own, where the node's directories are bind-mounted
at the standard paths (``/var/lib/kubelet``, ``/var/lib/cni``): the chart's defaults hold, each node's ramdisks and
publish targets stay its own, and a lost node's mounts (its RAM) go with its namespace. That namespace starts
private, like a host whose ``/`` is not a shared mount; only the kubelet's directory is shared, as the kubelet
makes it.

``path`` reads a node path as the node sees it (through ``/proc/<pid>/root``).
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers.kube.control_plane import ControlPlane
from tests.helpers.kube.node import KubeletNode, _cgroup_hierarchies
from tests.helpers.kube.pod_network import CLUSTER_DNS, CLUSTER_DOMAIN, add_address, cni_plugins

KUBELET_DIR = "/var/lib/kubelet"
"""The kubelet's root directory as the node sees it: the chart's default ``kubeletDir``."""
_NODE_DIRS = {KUBELET_DIR: "kubelet-root", "/var/lib/cni": "cni-state"}


class DeployNode(KubeletNode):
    """A node at ``address`` (``pod_network.node_address``) with pods in ``subnet`` and the OCI archives
    ``images`` in its containerd besides pause and busybox.

    ``lose`` ends it as a failure would: every process of the node SIGKILLed, its mount namespace (ramdisks, publish
    targets) gone; ``stop`` then tidies the rest.
    """

    snapshotter = "overlayfs"
    """Containers share their image's layers: with ``native``, each container copied its image whole (the trainer's
    1 GB, the agent's 0.5 GB), and a node loss's third node filled the disk of a CI machine (containerd: ``no space
    left on device``, the pod Pending). The overlay mounts live in the node's own mount namespace and end with it."""

    def __init__(self, plane: ControlPlane, address: str, subnet: str, images: list[Path]):
        super().__init__(plane, address)
        self.subnet = subnet
        self.images = images
        self.root_dir = Path(KUBELET_DIR)
        self.holder: subprocess.Popen | None = None

    def path(self, node_path: str) -> Path:
        """``node_path`` as this node sees it, read from this process."""
        assert self.holder is not None, "the node is not started"
        return Path(f"/proc/{self.holder.pid}/root") / node_path.lstrip("/")

    def mounts(self) -> dict[str, tuple[str, str]]:
        """The mounts of the node's mount namespace below its kubelet directory: mount point -> (mount ID, device),
        so that one mounted again is told from one that stayed."""
        assert self.holder is not None
        fields = [line.split() for line in Path(f"/proc/{self.holder.pid}/mountinfo").read_text().splitlines()]
        return {f[4]: (f[0], f[2]) for f in fields if f[4].startswith(KUBELET_DIR + "/")}

    def _start(self, deadline: float) -> None:
        add_address(self.address)
        self._enter_own_mounts()
        super()._start(deadline)

    def _enter_own_mounts(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for host_path in _NODE_DIRS:
            if not os.path.exists(host_path):
                os.makedirs(host_path)
                self._stack.callback(_remove_empty, host_path)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
        )
        self._stack.callback(_kill, self.holder)
        namespace = f"/proc/{self.holder.pid}/ns/mnt"
        for _ in range(100):
            if os.stat(namespace).st_ino != os.stat("/proc/self/ns/mnt").st_ino:
                break
            time.sleep(0.05)
        # Shared, as the kubelet makes its root on a host where it is a plain directory (a bind mount of its own, made
        # rshared); left private, the kubelet's would stack on this one, and containerd reads the lower of the two.
        script = " && ".join(
            f"mkdir -p {self.dir / name} && mount --bind {self.dir / name} {host_path} && mount --make-rshared {host_path}"
            for host_path, name in _NODE_DIRS.items()
        )
        subprocess.run(self._command(["sh", "-c", script]), check=True, capture_output=True, timeout=30)

    def _command(self, argv: list[str]) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", *argv]

    def _images(self) -> list[Path]:
        return [*super()._images(), *self.images]

    def _cni_plugins(self) -> list[dict]:
        return cni_plugins(self.subnet, self.dir / "cni-ipam")

    def _kubelet_config(self) -> dict:
        resolv = self.dir / "resolv.conf"
        resolv.write_text("")  # the pods' DNS is the cluster's alone, not this machine's resolvers
        return {"clusterDNS": [CLUSTER_DNS], "clusterDomain": CLUSTER_DOMAIN, "resolvConf": str(resolv)}

    def lose(self) -> None:
        """The node fails: kubelet, containerd, its containers' shims and processes SIGKILLed, its mount namespace
        (and so its ramdisks) gone. The Node object stays, as it does until the cloud provider removes it."""
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.popen.wait()
        shims = [
            pid for pid, argv in _processes() if argv and "containerd-shim" in argv[0] and str(self.socket) in argv
        ]
        for pid in [*shims, *self._container_pids()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.holder is not None:
            _kill(self.holder)

    def _container_pids(self) -> set[int]:
        pids: set[int] = set()
        for hierarchy in _cgroup_hierarchies():
            for procs in (hierarchy / self.cgroup_root.lstrip("/")).rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(pid) for pid in procs.read_text().split())
        return pids


def _processes():
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                yield int(entry.name), [a.decode(errors="replace") for a in argv if a]


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def _remove_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)
