"""Runs the product's processes on one machine: a coordinator, node agents on loopback addresses and
training pods.

``make demo`` (``examples/demo.py``) runs it, so it stays with the examples; the tests and benches use
it too (``tests/helpers`` holds what only they need: the object-store servers, ports, polling).
Each node agent is a real ``mtc node`` process with its own root, CSI socket and HTTP address;
killing one with SIGKILL is what a node failure does to it.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import grpc
import msgspec
import psutil

from csi_driver import kubelet, mounts
from protos import csi_pb2, csi_pb2_grpc
from replicator.coordinator.api.status import fetch_status
from replicator.wire import tls
from replicator.wire.operator import ClusterStatus


def unmount_all_below(prefix: str) -> None:
    """Unmounts every mount at or below ``prefix``, deepest first (test and demo teardown)."""
    prefix = os.path.realpath(prefix)
    points = {
        e.mount_point
        for e in mounts.mount_table()
        if e.mount_point == prefix or e.mount_point.startswith(prefix + os.sep)
    }
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[tuple[str, contextlib.ExitStack]]:
    """A temporary directory that leaves the machine as it was found, on success, error and Ctrl-C.

    Yields (directory, ExitStack). Callbacks added to the stack (stopping processes) run first, in
    reverse order; then every mount below the directory is unmounted and the directory removed
    (``rm --one-file-system``: never through a mount that is still there). SIGINT and SIGTERM
    are ignored while that runs, so a second Ctrl-C cannot cut it short. Main thread only.
    """
    handlers: dict[signal.Signals, object] = {}
    with contextlib.ExitStack() as cleanup:
        workdir = tempfile.mkdtemp(prefix=prefix)
        cleanup.callback(lambda: [signal.signal(sig, handler) for sig, handler in handlers.items()])
        cleanup.callback(subprocess.run, ["rm", "-rf", "--one-file-system", workdir], check=False)
        cleanup.callback(unmount_all_below, workdir)
        try:
            yield workdir, cleanup
        finally:
            handlers.update({sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)})


def can_mount_tmpfs() -> bool:
    """True when this process may mount a tmpfs (root, or CAP_SYS_ADMIN)."""
    return os.geteuid() == 0


def source_env(source: str | None, env: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """(environment, working directory) of a process that runs the code of ``source``, a source tree
    (an older release's, extracted with ``git archive``), or of this tree for None. The working
    directory too: ``python -m`` puts it before ``PYTHONPATH``."""
    merged = {**os.environ, **(env or {})}
    return ({**merged, "PYTHONPATH": source}, source) if source else (merged, None)


class _Stoppable:
    """Kill and stop for a class holding its ``subprocess.Popen`` in ``self.process``."""

    process: subprocess.Popen | None

    def kill(self) -> None:
        """SIGKILLs the process, as a node failure or OOM kill would."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOPs the process: a frozen node (a stalled VM, a long GC pause, a network partition)."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONTs a paused process."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the process with SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.process and self.process.poll() is None:
            self.resume()  # a paused process would not act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclasses.dataclass
class NodeAgentProcess(_Stoppable):
    """One ``mtc node`` process.

    Attributes:
      node_id: the node's name.
      workdir: directory holding this node's root, socket and log.
      listen: ``HOST:PORT`` of its HTTP side, e.g. ``127.0.0.2:8470``.
      backend: ``tmpfs`` or ``dir``.
      extra_args: further ``mtc node`` flags.
      env: further environment variables (e.g. ``STORAGE_EMULATOR_HOST``).
      wrapper: a module that runs the agent's module (``python -m WRAPPER ... -m <agent module>``),
        e.g. ``["tests.bench.profiled", OUT]``; empty to run it directly.
      source: the source tree the agent runs from (another release's: ``source_env``), or None for this one.
    """

    node_id: str
    workdir: str
    listen: str
    backend: str = "tmpfs"
    extra_args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    wrapper: list[str] = dataclasses.field(default_factory=list)
    source: str | None = None
    process: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return os.path.join(self.workdir, "root")

    @property
    def endpoint(self) -> str:
        return "unix://" + os.path.join(self.workdir, "csi.sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "agent.log")

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def ramdisk(self, job: str, namespace: str = "default") -> str:
        """The job's ramdisk on this node: ``client/`` (what the pod sees) and ``mtc/`` (agent metadata)."""
        return os.path.join(self.root, "jobs", namespace, job)

    def command(self) -> list[str]:
        return [
            sys.executable,
            *(["-m", *self.wrapper] if self.wrapper else []),
            "-m",
            "replicator.cli",
            "node",
            "--node-id",
            self.node_id,
            "--root",
            self.root,
            "--csi-endpoint",
            self.endpoint,
            "--listen",
            self.listen,
            "--ramdisk-backend",
            self.backend,
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0) -> "NodeAgentProcess":
        """Starts the agent and waits until its CSI ``Probe`` reports ready.

        Raises:
          RuntimeError: the agent exited or did not become ready within ``timeout`` seconds.
        """
        os.makedirs(self.workdir, exist_ok=True)
        env, cwd = source_env(self.source, self.env)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"node agent {self.node_id} exited with {self.process.returncode}: {self.tail_log()}"
                )
            if self._probe_ready():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"node agent {self.node_id} not ready after {timeout} s: {self.tail_log()}")

    def _probe_ready(self) -> bool:
        # A fresh channel per attempt: a failed connect puts a channel into seconds of backoff.
        try:
            with grpc.insecure_channel(self.endpoint) as channel:
                return csi_pb2_grpc.IdentityStub(channel).Probe(csi_pb2.ProbeRequest(), timeout=1).ready.value
        except grpc.RpcError:
            return False

    def tail_log(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except FileNotFoundError:
            return ""


def self_signed_certificate(directory: str, host: str = "127.0.0.1") -> tuple[str, str]:
    """A certificate for ``host`` (an IP) and its ECDSA P-256 key (as the chart makes them), made with ``openssl``
    in ``directory``; the certificate is its own CA. Returns (certificate path, key path)."""
    cert, key = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
    if not os.path.exists(cert):
        os.makedirs(directory, exist_ok=True)
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=mtc-local",
                "-addext",
                f"subjectAltName=IP:{host}",
                "-keyout",
                key,
                "-out",
                cert,
            ],
            check=True,
            capture_output=True,
        )
    return cert, key


@dataclasses.dataclass
class CoordinatorProcess(_Stoppable):
    """One ``mtc coordinator`` process on loopback.

    Attributes:
      tls: (certificate, key) to serve HTTPS with, the certificate being its own CA; None for HTTP.
      source: the source tree it runs from (another release's: ``source_env``), or None for this one.
    """

    workdir: str
    listen: str
    extra_args: list[str] = dataclasses.field(default_factory=list)
    tls: tuple[str, str] | None = None
    source: str | None = None
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.listen}"

    @property
    def ca_file(self) -> str | None:
        return self.tls[0] if self.tls else None

    def ssl_context(self) -> ssl.SSLContext | None:
        """What a client checks this coordinator's certificate with."""
        return tls.client_context(self.ca_file)

    def status_struct(self, job: str | None = None) -> ClusterStatus:
        """``GET /v1/status`` of this coordinator, typed; with ``job`` (a name), only the jobs of that name:
        none while no node has reported one (where ``mtc status --job`` is refused with a 404)."""
        status = fetch_status(self.url, None, self.ca_file)
        return (
            status
            if job is None
            else msgspec.structs.replace(status, jobs=tuple(j for j in status.jobs if j.job == job))
        )

    def status(self, job: str | None = None) -> dict:
        """``mtc status --json`` of this coordinator: plain JSON values, as the wire carries them."""
        return msgspec.json.decode(msgspec.json.encode(self.status_struct(job)))

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "coordinator.log")

    def start(self, timeout: float = 30.0) -> "CoordinatorProcess":
        """Starts the coordinator and waits for ``/healthz``.

        Raises:
          RuntimeError: it exited or did not answer within ``timeout`` seconds.
        """
        os.makedirs(self.workdir, exist_ok=True)
        tls_flags = ["--tls-cert", self.tls[0], "--tls-key", self.tls[1]] if self.tls else []
        command = [
            sys.executable,
            "-m",
            "replicator.cli",
            "coordinator",
            "--listen",
            self.listen,
            "--state-dir",
            os.path.join(self.workdir, "state"),
            *tls_flags,
            *self.extra_args,
        ]
        env, cwd = source_env(self.source)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1, context=self.ssl_context()):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"coordinator not ready after {timeout} s")


class LocalCluster:
    """A coordinator and node agents on 127.0.0.x, each a real process.

    Node ``i`` listens on ``<subnet>.<i+1>`` (127.0.0.<i+1> by default; pods on it too) and sits in topology
    block ``b<i // 2>``.

    Args:
      workdir: where every process keeps its root, socket and log.
      listen_address: ``host -> "HOST:PORT"``, a free address on that loopback host.
      replicas: ``--replicas`` of every agent.
      peer_tier: give agents the cluster token (replication, restore from peers); without it the
        coordinator runs ``--insecure``. The coordinator always serves HTTPS with a self-signed
        certificate the agents are given as ``--coordinator-ca``.
      backup: ``--backup`` URL of every agent, or None.
      env: environment of the agents (e.g. ``STORAGE_EMULATOR_HOST``).
      agent_args: further ``mtc node`` flags of every agent (e.g. ``--background-cpu``).
      agent_wrapper: ``NodeAgentProcess.wrapper`` of every agent.
      kubeconfig: a kubeconfig of a real API server: the coordinator runs ``--kube`` with it, and the agents pass
        no ``--pod-address`` or ``--topology`` (pod IPs and node labels come from the API server). Node ``i`` is
        then the API server's Node ``node-<i>``.
      subnet: the first three bytes of the nodes' loopback addresses, e.g. ``127.0.0``.
      peer_grants: the coordinator signs peer grants and the agents serve peers only against them (both
        ``--peer-grants``; without ``node_identity`` the coordinator has no per-node identity to tie them to).
      node_identity: with ``kubeconfig``, the namespace of the agents' DaemonSet: the coordinator admits a node's
        report only with a projected token of that DaemonSet's pod on the node (``--node-identity
        --agent-namespace``), or None.
      node_token: ``node name -> path`` of the agent's projected ServiceAccount token (``--node-token-file``),
        called as each node joins (a fresh node's token is minted then), or None to send none.
      coordinator_source: the source tree the coordinator runs from (``CoordinatorProcess.source``), or
        None for this one; ``add_node`` takes the agents'.
    """

    def __init__(
        self,
        workdir: str,
        listen_address: Callable[[str], str],
        replicas: int = 1,
        peer_tier: bool = True,
        backup: str | None = None,
        env: dict[str, str] | None = None,
        agent_args: list[str] | None = None,
        agent_wrapper: list[str] | None = None,
        kubeconfig: str | None = None,
        subnet: str = "127.0.0",
        coordinator_source: str | None = None,
        peer_grants: bool = False,
        node_identity: str | None = None,
        node_token: Callable[[str], str] | None = None,
    ):
        if node_identity is not None and (kubeconfig is None or not peer_tier):
            raise ValueError("node_identity needs kubeconfig and the peer tier's cluster token")
        self.workdir = workdir
        self._listen_address = listen_address
        self.replicas = replicas
        self.peer_tier = peer_tier
        self.backup = backup
        self.env = env or {}
        self.agent_args = [*(agent_args or []), *(["--peer-grants"] if peer_grants else [])]
        self.agent_wrapper = agent_wrapper or []
        self.kubeconfig = kubeconfig
        self.subnet = subnet
        self.node_token = node_token
        self.token_file = os.path.join(workdir, "peer-token")
        os.makedirs(workdir, exist_ok=True)
        with open(self.token_file, "w", encoding="utf-8") as f:
            f.write(uuid.uuid4().hex + "\n")
        self.coordinator = CoordinatorProcess(
            os.path.join(workdir, "coordinator"),
            listen_address("127.0.0.1"),
            [
                "--node-timeout-seconds",
                "4",
                *(["--token-file", self.token_file] if peer_tier else ["--insecure"]),
                *(["--kube", "--kubeconfig", kubeconfig] if kubeconfig else []),
                *(["--peer-grants"] if peer_grants else []),
                *(["--node-identity", "--agent-namespace", node_identity] if node_identity else []),
            ],
            tls=self_signed_certificate(os.path.join(workdir, "tls")),
            source=coordinator_source,
        )
        self.agents: list[NodeAgentProcess] = []

    def start(self, nodes: int) -> "LocalCluster":
        """Starts the coordinator and nodes ``0 .. nodes-1``."""
        self.coordinator.start()
        for index in range(nodes):
            self.add_node(index)
        return self

    def add_node(
        self, index: int, block: str | None = None, source: str | None = None, token_file: str | None = None
    ) -> NodeAgentProcess:
        """Starts node ``index`` (a fresh node when its predecessor was lost), from the source tree
        ``source`` (``NodeAgentProcess.source``) or this one, with ``token_file`` (its own copy of the
        cluster's Secret) or the cluster's, and with ``node_token``'s projected token if given."""
        host, name = f"{self.subnet}.{index + 1}", f"node-{index}"
        agent = NodeAgentProcess(
            name,
            os.path.join(self.workdir, f"node-{index}"),
            self._listen_address(host),
            "tmpfs" if can_mount_tmpfs() else "dir",
            [
                "--coordinator",
                self.coordinator.url,
                "--coordinator-ca",
                self.coordinator.ca_file,
                *(
                    []
                    if self.kubeconfig
                    else ["--pod-address", host, "--topology", f"block={block or f'b{index // 2}'}"]
                ),
                "--replicas",
                str(self.replicas),
                *(["--peer-token-file", token_file or self.token_file] if self.peer_tier else []),
                *(["--backup", self.backup] if self.backup else []),
                *(["--node-token-file", self.node_token(name)] if self.node_token else []),
                *self.agent_args,
            ],
            env=self.env,
            wrapper=self.agent_wrapper,
            source=source,
        )
        self.agents.append(agent)
        return agent.start()

    def lose_node(self, agent: NodeAgentProcess) -> None:
        """What a node failure does: the agent dies and the node's RAM (every ramdisk) is gone."""
        agent.kill()
        unmount_all_below(agent.workdir)
        with contextlib.suppress(FileNotFoundError):  # kept beside it, to read after a failed test
            os.replace(agent.log_path, agent.workdir.rstrip("/") + "-lost-agent.log")
        shutil.rmtree(agent.workdir)

    def stop(self) -> None:
        for process in [*self.agents, self.coordinator]:
            process.stop()
        unmount_all_below(self.workdir)


TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


@dataclasses.dataclass
class Pod:
    """A training pod: its published ramdisk and, once started, its training process."""

    name: str
    node: NodeAgentProcess
    target: str
    log_path: str
    process: subprocess.Popen | None = None

    def events(self) -> list[dict]:
        """The JSON events the training process printed so far."""
        try:
            with open(self.log_path, encoding="utf-8") as log:
                return [json.loads(line) for line in log if line.startswith("{")]
        except FileNotFoundError:
            return []


@dataclasses.dataclass
class LocalJob:
    """A JobSet-like training job on local node agents: ``slices`` x ``nodes_per_slice`` pods,
    pod ``i`` on node agent ``i``, each running ``examples/train.py`` in its ramdisk.

    Attributes:
      name: the JobSet name; pods are ``<name>-slice-<slice>-<worker>-<suffix>``.
      agents: one node agent per pod.
      workdir: where pod targets and logs go.
      train_args: ``train.py`` flags besides the local dir and job shape.
      slices: number of slices.
      size: ramdisk size attribute.
      jax_port: the JAX coordinator port (``jaxCoordinatorPort``).
      framework: the volume attribute ``framework``: the files the trainer speaks.
    """

    name: str
    agents: list[NodeAgentProcess]
    workdir: str
    train_args: list[str]
    slices: int = 2
    size: str = "256Mi"
    jax_port: int = 8476
    framework: str = "orbax"
    pods: list[Pod] = dataclasses.field(default_factory=list)
    incarnations: int = 0

    @property
    def job(self) -> str:
        """The job key the driver derives from the JobSet pod names."""
        return f"{self.name}-slice"

    def create_pods(self) -> list[Pod]:
        """Publishes a new pod on every node, as kubelet does for a recreated JobSet."""
        self.incarnations += 1
        per_slice = len(self.agents) // self.slices
        attrs = {
            "nodes": str(len(self.agents)),
            "slices": str(self.slices),
            "size": self.size,
            "jaxCoordinatorPort": str(self.jax_port),
            "jobset": self.name,
            "framework": self.framework,
        }
        self.pods = []
        for index, agent in enumerate(self.agents):
            name = f"{self.job}-{index // per_slice}-{index % per_slice}-i{self.incarnations}"
            target = os.path.join(self.workdir, "pods", name, "mount")
            kubelet.publish(agent.endpoint, target, name, attributes=attrs)
            self.pods.append(Pod(name, agent, target, os.path.join(self.workdir, "logs", f"{name}.jsonl")))
        return self.pods

    def train_command(self, pod: Pod) -> list[str]:
        """The training process of ``pod``: ``examples/train.py`` (a subclass may run another trainer)."""
        return [
            sys.executable,
            TRAIN_SCRIPT,
            "--local-dir",
            pod.target,
            "--run-name",
            self.name,
            "--num-slices",
            str(self.slices),
            "--nodes",
            str(len(self.agents)),
            *self.train_args,
        ]

    def train_env(self) -> dict[str, str]:
        """The training processes' environment: JAX on CPU, with the process count for the CPU-only
        ``ClusterEnv`` of ``examples/cpu_cluster.py``."""
        return {**os.environ, "JAX_PLATFORMS": "cpu", "MTC_NUM_PROCESSES": str(len(self.agents))}

    def start_training(self) -> None:
        """Starts the trainer in every pod."""
        env = self.train_env()
        for pod in self.pods:
            os.makedirs(os.path.dirname(pod.log_path), exist_ok=True)
            with open(pod.log_path, "wb") as out, open(pod.log_path + ".stderr", "wb") as err:
                pod.process = subprocess.Popen(self.train_command(pod), stdout=out, stderr=err, env=env)

    def _trainers(self) -> list[psutil.Process]:
        """Every pod's running trainer and every process below it (torchrun starts its workers in
        their own sessions: a process group would miss them, as a container's cgroup does not)."""
        found = []
        for pod in self.pods:
            if pod.process and pod.process.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    parent = psutil.Process(pod.process.pid)
                    found += [parent, *parent.children(recursive=True)]
        return found

    def signal_training(self, signum: int) -> None:
        """Sends ``signum`` to every pod's trainer and the processes it started."""
        for process in self._trainers():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signum)

    def kill_training(self) -> None:
        """SIGKILLs every training process, as a preemption or node failure would."""
        self.signal_training(signal.SIGSTOP)  # no process forks or exits while the tree is read
        trainers = self._trainers()
        for process in trainers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(trainers, timeout=30)
        for pod in self.pods:
            if pod.process:
                pod.process.wait()

    def delete_pods(self) -> None:
        """Kills the training processes and unpublishes the pods' volumes (kubelet's part).

        A pod whose node is gone is force-deleted: nothing is left to unpublish it.
        """
        self.kill_training()
        for pod in self.pods:
            if pod.node.process is not None and pod.node.process.poll() is None:
                kubelet.unpublish(pod.node.endpoint, pod.target)

    def wait(self, condition, timeout: float, what: str) -> None:
        """Waits until ``condition()`` holds; raises ``TimeoutError`` naming ``what`` and the logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            failed = [p for p in self.pods if p.process and p.process.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"training process {failed[0].name} exited {failed[0].process.returncode}: {self._stderr(failed[0])}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"{what} not reached within {timeout} s; {self._stderr(self.pods[0])}")

    def wait_done(self, timeout: float) -> None:
        self.wait(lambda: all(p.process.poll() == 0 for p in self.pods), timeout, "training done")

    @staticmethod
    def _stderr(pod: Pod) -> str:
        try:
            with open(pod.log_path + ".stderr", encoding="utf-8", errors="replace") as f:
                return f.read()[-3000:]
        except FileNotFoundError:
            return ""
