"""A real node: Debian's containerd and runc and a kubelet, registered with a ``ControlPlane``, for pods with
``hostNetwork: true`` and images built here (``images.py``, ``imagePullPolicy: Never``).

What the kubelet changes outside its scratch directory is put back on ``stop``: the kernel settings it sets, the
cgroup root made for it in every cgroup v1 hierarchy, the iptables chains it adds, and the directories under /var/lib
and /run that it or containerd's shims create.
"""

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import yaml
from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Node

from tests.helpers.kube.control_plane import ControlPlane, _Process, _Started, write_kubeconfig
from tests.helpers.kube.images import busybox_image
from tests.helpers.ports import free_port

PAUSE_IMAGE = "mtc.local/pause:1"
BUSYBOX_IMAGE = "mtc.local/busybox:1"

# What the kubelet sets when protectKernelDefaults is false (pkg/kubelet/cm/container_manager_linux.go).
_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# Created outside the scratch directory by the kubelet or containerd's shims (1.6 puts shim sockets in
# /run/containerd/s whatever its state directory); removed when they were not there before.
_HOST_DIRS = ("/var/lib/kubelet", "/var/lib/cni", "/run/containerd", "/run/netns")


class _SharedHostDirs:
    """The nodes of this process share _HOST_DIRS: those absent when the first node starts go when the last one
    stops. runc keeps every node's container state in /run/containerd/runc: removed by the first node to stop while
    another still ran containers (an agent pod), that node's containerd could neither kill nor delete them, and its
    stop waited on ``ctr`` for minutes."""

    nodes = 0
    made: tuple[str, ...] = ()

    @classmethod
    def take(cls) -> None:
        if cls.nodes == 0:
            cls.made = tuple(d for d in _HOST_DIRS if not os.path.exists(d))
        cls.nodes += 1

    @classmethod
    def release(cls) -> None:
        cls.nodes -= 1
        if cls.nodes == 0:
            for directory in cls.made:
                shutil.rmtree(directory, ignore_errors=True)


_CNI_BIN = "/usr/lib/cni"


# The iptables chains the kubelet makes in its network namespace (pkg/kubelet/kubelet_network_linux.go), in both
# families; KUBE-FIREWALL drops connections to 127.0.0.0/8 from other sources, which the network-fault harness makes.
_KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY")
_TABLES = ("filter", "nat", "mangle")


def _kubelet_chains() -> set[tuple[str, str, str]]:
    """(binary, table, chain) of each of the kubelet's chains present now."""
    present = set()
    for binary in ("iptables", "ip6tables"):
        for table in _TABLES:
            rules = subprocess.run([binary, "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
            present |= {(binary, table, chain) for chain in _KUBELET_CHAINS if f"-N {chain}" in rules}
    return present


def _remove_kubelet_chains(chains: set[tuple[str, str, str]]) -> None:
    """Removes ``chains`` and every rule that jumps to them."""
    for binary, table, chain in sorted(chains):
        rules = subprocess.run([binary, "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
        for rule in rules:
            if rule.startswith("-A ") and rule.endswith(f"-j {chain}"):
                subprocess.run([binary, "-t", table, "-D", *shlex.split(rule)[1:]], capture_output=True)
        subprocess.run([binary, "-t", table, "-F", chain], capture_output=True)
        subprocess.run([binary, "-t", table, "-X", chain], capture_output=True)


def _cgroup_hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies, the kubelet's cgroup root is made in each; the unified one (cgroup v2, hybrid
    mode) is left to the kubelet, which makes it there too."""
    root = Path("/sys/fs/cgroup")
    return [h for h in sorted(root.iterdir()) if h.is_dir() and h.name != "unified" and (h / "cgroup.procs").exists()]


def _remove_cgroup_tree(path: Path) -> None:
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


class KubeletNode(_Started):
    """One node: containerd (its own root, state and socket) and a kubelet (its own root dir, ports, cgroup root
    and client certificate ``system:node:<name>``).

    The node is named after the loopback address its kubelet serves on (``127.0.0.2``: a valid node name). The
    API server reaches a kubelet (logs, exec) at the Node's ``Hostname`` address first, which is that name; the
    kubelet refuses a loopback ``--node-ip``, and its InternalIP (this machine's own address) is not one the
    tests may send to. ``start`` starts containerd, imports the images, starts the kubelet and returns once the
    Node is Ready; ``stop`` also puts the host back (sysctls, cgroup roots, host directories).

    Args:
      plane: a started control plane; the node's files go in its scratch directory.
      address: a 127.0.0.0/8 address other than 127.0.0.1 (the control plane's); also the node's name.
    """

    snapshotter = "native"
    """containerd's snapshotter: ``native`` copies an image's whole filesystem for each container, and leaves no
    mount behind in this machine's mount namespace when the node is killed."""

    def __init__(self, plane: ControlPlane, address: str = "127.0.0.2"):
        super().__init__()
        self.plane = plane
        self.address = self.name = address
        self.dir = plane.workdir / "nodes" / address
        self.socket = self.dir / "containerd.sock"
        # The kubelet's --root-dir: pods/<uid>/volumes/... and plugins_registry are below it.
        self.root_dir = self.dir / "kubelet"

    def ctr(self, *args: str) -> str:
        """``ctr`` against this node's containerd, in the CRI's namespace."""
        return subprocess.run(
            ["ctr", "--address", str(self.socket), "-n", "k8s.io", *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    def _start(self, deadline: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._protect_host()
        containerd = self._start_containerd()
        self._wait(lambda: self.socket.exists() and self._ctr_answers(), deadline, "containerd answers", containerd)
        for archive in self._images():
            self.ctr("images", "import", "--snapshotter", self.snapshotter, str(archive))
        kubelet = self._start_kubelet()
        client = self.plane.client()
        self._wait(lambda: _ready(client, self.name), deadline, f"Node {self.name} Ready", kubelet)

    def _images(self) -> list[Path]:
        """The OCI archives imported into the node's containerd: the pause image and busybox."""
        archives = []
        for reference, entrypoint in ((PAUSE_IMAGE, ["/bin/sleep", "2147483647"]), (BUSYBOX_IMAGE, None)):
            path = self.dir / f"{reference.split('/')[-1].replace(':', '-')}.tar"
            archives.append(busybox_image(path, reference, entrypoint))
        return archives

    def _cni_plugins(self) -> list[dict]:
        """The CNI plugins of the pods' network: loopback alone (the pods use the host's network)."""
        return [{"type": "loopback"}]

    def _kubelet_config(self) -> dict:
        """What a subclass adds to the KubeletConfiguration."""
        return {}

    def _command(self, argv: list[str]) -> list[str]:
        """How a node process is started (a subclass starts it in the node's own mount namespace)."""
        return argv

    def _protect_host(self) -> None:
        sysctls = {name: Path("/proc/sys", name).read_text() for name in _SYSCTLS}

        def restore() -> None:
            for name, value in sysctls.items():
                with contextlib.suppress(OSError):
                    Path("/proc/sys", name).write_text(value)

        self._stack.callback(restore)
        before = _kubelet_chains()
        self._stack.callback(lambda: _remove_kubelet_chains(_kubelet_chains() - before))
        _SharedHostDirs.take()
        self._stack.callback(_SharedHostDirs.release)
        self.cgroup_root = f"/mtc-kubelet-{self.name}"
        for hierarchy in _cgroup_hierarchies():
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":  # a new cpuset cgroup has no CPUs and memory nodes until given them
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (path / knob).write_text((hierarchy / knob).read_text())
            self._stack.callback(_remove_cgroup_tree, path)
        unified = Path("/sys/fs/cgroup/unified") / self.cgroup_root.lstrip("/")
        if unified.parent.is_dir() and not unified.exists():
            self._stack.callback(_remove_cgroup_tree, unified)

    def _start_containerd(self) -> _Process:
        cni = self.dir / "cni"
        cni.mkdir()
        (cni / "10-pods.conflist").write_text(
            json.dumps({"cniVersion": "0.4.0", "name": "mtc-pods", "plugins": self._cni_plugins()})
        )
        cri = '[plugins."io.containerd.grpc.v1.cri"]'
        config = f"""version = 2
root = "{self.dir / "containerd-root"}"
state = "{self.dir / "containerd-state"}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.dir / "containerd-opt"}"
{cri}
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "{free_port()}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "{self.snapshotter}"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{_CNI_BIN}"
    conf_dir = "{cni}"
"""
        config_file = self.dir / "containerd.toml"
        config_file.write_text(config)
        process = _Process(
            "containerd", self._command(["containerd", "--config", str(config_file)]), self.dir / "containerd.log"
        )
        self.processes["containerd"] = process
        self._stack.callback(process.stop)
        self._stack.callback(self._remove_containers)
        return process

    def _remove_containers(self) -> None:
        """Every task killed and deleted, then every container, so no shim outlives the node."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            tasks = [line.split()[0] for line in self.ctr("tasks", "ls").splitlines()[1:] if line.strip()]
            for task in tasks:
                with contextlib.suppress(subprocess.SubprocessError):
                    self.ctr("tasks", "kill", "-s", "SIGKILL", task)
            for task in tasks:
                for _ in range(50):
                    try:
                        self.ctr("tasks", "delete", "-f", task)
                        break
                    except subprocess.SubprocessError:
                        time.sleep(0.1)
            containers = self.ctr("containers", "ls", "-q").split()
            if containers:
                self.ctr("containers", "delete", *containers)

    def _ctr_answers(self) -> bool:
        try:
            self.ctr("version")
            return True
        except subprocess.SubprocessError:
            return False

    def _start_kubelet(self) -> _Process:
        ca = self.plane.ca
        identity = ca.issue(f"kubelet-{self.name}", f"system:node:{self.name}", organizations=("system:nodes",))
        serving = ca.issue(f"kubelet-{self.name}-serving", self.name, dns_names=("localhost",), ips=(self.address,))
        kubeconfig = write_kubeconfig(self.dir / "kubelet.kubeconfig", self.plane.url, ca.pair, identity, self.name)
        self.port = free_port(self.address)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.address,
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": self.address,
            "healthzPort": free_port(self.address),
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(ca.pair.cert)},
            },
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": str(self.dir / "pod-logs"),
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "localStorageCapacityIsolation": False,
            "registerNode": True,
            **self._kubelet_config(),
        }
        config_file = self.dir / "kubelet.yaml"
        config_file.write_text(yaml.safe_dump(config))
        process = _Process(
            "kubelet",
            self._command(
                [
                    shutil.which("kubelet") or str(Path(self.plane.binaries.apiserver).parent / "kubelet"),
                    f"--config={config_file}",
                    f"--kubeconfig={kubeconfig}",
                    f"--root-dir={self.root_dir}",
                    f"--hostname-override={self.name}",
                    *([] if self.address.startswith("127.") else [f"--node-ip={self.address}"]),
                ]
            ),
            self.dir / "kubelet.log",
        )
        self.processes["kubelet"] = process
        self._stack.callback(process.stop)
        return process

    def _wait(self, condition, deadline: float, what: str, process: _Process) -> None:
        while not condition():
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not reached in time:\n{process.tail()}")
            time.sleep(0.3)


def _ready(client: Client, name: str) -> bool:
    try:
        node = client.get(Node, name)
    except ApiError as error:
        if error.status.code == 404:
            return False
        raise
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
