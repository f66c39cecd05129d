"""Runs the product's processes on one machine: node agents on loopback addresses.

The demo and the end-to-end tests both use it. Each node agent is a real ``mtc node`` process with
its own root, CSI socket and HTTP address; killing one with SIGKILL is what a node failure does to it.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc

from csi_driver import mounts
from protos import csi_pb2, csi_pb2_grpc


def unmount_all_below(prefix: str) -> None:
    """Unmounts every mount at or below ``prefix``, deepest first (test and demo teardown)."""
    prefix = os.path.realpath(prefix)
    points = {e.mount_point for e in mounts.mount_table() if e.mount_point == prefix or e.mount_point.startswith(prefix + os.sep)}
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def can_mount_tmpfs() -> bool:
    """True when this process may mount a tmpfs (root, or CAP_SYS_ADMIN)."""
    return os.geteuid() == 0


@dataclasses.dataclass
class NodeAgentProcess:
    """One ``mtc node`` process.

    Attributes:
      node_id: the node's name.
      workdir: directory holding this node's root, socket and log.
      listen: ``HOST:PORT`` of its HTTP side, e.g. ``127.0.0.2:8470``.
      backend: ``tmpfs`` or ``dir``.
      extra_args: further ``mtc node`` flags.
    """

    node_id: str
    workdir: str
    listen: str
    backend: str = "tmpfs"
    extra_args: list[str] = dataclasses.field(default_factory=list)
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

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "csi_driver.cli", "node",
            "--node-id", self.node_id, "--root", self.root, "--csi-endpoint", self.endpoint,
            "--listen", self.listen, "--ramdisk-backend", self.backend, *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> "NodeAgentProcess":
        """Starts the agent and waits until its CSI ``Probe`` reports ready.

        Raises:
          RuntimeError: the agent exited or did not become ready within ``timeout`` seconds.
        """
        os.makedirs(self.workdir, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"node agent {self.node_id} exited with {self.process.returncode}: {self.tail_log()}")
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

    def kill(self) -> None:
        """SIGKILLs the agent, as a node failure or OOM kill would."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the agent with SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail_log(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except FileNotFoundError:
            return ""


@dataclasses.dataclass
class CoordinatorProcess:
    """One ``mtc coordinator`` process on loopback."""

    workdir: str
    listen: str
    extra_args: list[str] = dataclasses.field(default_factory=list)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "coordinator.log")

    def start(self, timeout: float = 30.0) -> "CoordinatorProcess":
        """Starts the coordinator and waits for ``/healthz``.

        Raises:
          RuntimeError: it exited or did not answer within ``timeout`` seconds.
        """
        os.makedirs(self.workdir, exist_ok=True)
        command = [sys.executable, "-m", "csi_driver.cli", "coordinator", "--listen", self.listen,
                   "--state-dir", os.path.join(self.workdir, "state"), *self.extra_args]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"coordinator not ready after {timeout} s")

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
