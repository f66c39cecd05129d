"""The product installed as users install it, on ``DeployNode``s (``make e2e-deploy``): the README's Kubernetes quick
start run word for word with ``kubectl`` and ``helm``, and what the tests do to the cluster afterwards.

The README's commands are taken from the README itself (``quick_start_commands``), so a quick start that stops
working fails the suite. The two departures, both for what this machine cannot reach, are applied here and nowhere
else: the image is built by the Makefile (``make image IMAGE=localhost/mtc-agent:VERSION``, the README's own command
with ``localhost`` for ``REGISTRY``) and imported into each node's containerd instead of pushed; and the
livenessprobe sidecar is a stand-in image (``tests/deploy/livenessprobe.Dockerfile``), named as such.
"""

import json
import os
import re
import subprocess
from pathlib import Path

from lightkube import Client
from lightkube.resources.core_v1 import Node

from tests.helpers import REPO
from tests.helpers.kube.control_plane import ControlPlane
from tests.helpers.kube.deploy_node import DeployNode
from tests.helpers.kube.pod_network import node_address, pod_cidr

VERSION = re.search(r'^version = "(.*)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
REGISTRY = "localhost"
TRAINING_NAMESPACE = "train"
RELEASE_NAMESPACE = "mtc-system"
IMAGES = ("mtc-agent", "livenessprobe-standin", "mtc-trainer")
STAND_IN_VALUES = [f"--set sidecars.livenessProbe.image={REGISTRY}/livenessprobe-standin:{VERSION}"]
_COMMENT = re.compile(r"(^|\s+)#.*$")


def quick_start_commands(readme: Path = REPO / "README.md") -> list[str]:
    """The shell commands of ``readme``'s "Kubernetes quick start" (its first ``sh`` block), one string per command:
    continued lines joined, comments dropped, and the lines whose comment says ``optional`` left out."""
    text = readme.read_text(encoding="utf-8").split("## Kubernetes quick start", 1)[1]
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    commands, parts = [], []
    for line in block.splitlines():
        comment = line[m.start() :] if (m := _COMMENT.search(line)) else ""
        code = _COMMENT.sub("", line).rstrip()
        continues = code.endswith("\\")
        if "optional" not in comment:
            parts.append(code.removesuffix("\\").strip())
        if not continues and any(parts):
            commands.append(" ".join(p for p in parts if p))
            parts = []
    return commands


class Deployment:
    """The cluster of the deployment suite: ``plane`` and its ``nodes``, ``kubectl`` and ``helm`` against it.

    Args:
      archives: the OCI archives of ``IMAGES`` that each node's containerd imports.
    """

    def __init__(self, plane: ControlPlane, nodes: list[DeployNode], archives: list[Path]):
        self.plane = plane
        self.nodes = nodes
        self.archives = archives
        self.lost: list[DeployNode] = []
        self._node_count = len(nodes)  # nodes ever started: a fresh one never reuses a lost one's address
        self.env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig), "HOME": str(plane.workdir)}

    def client(self) -> Client:
        return self.plane.client()

    def sh(self, command: str, timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
        """``command`` in bash (kubectl, helm and make on PATH) from the repository's root."""
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.sh(" ".join(["kubectl", *args, "-o", "json"])).stdout)

    def run_quick_start(self) -> list[str]:
        """Runs the README's quick start against the cluster; returns the commands run. The image command is the
        Makefile's (it built the image with it); the helm install gets the stand-in sidecar image."""
        ran = []
        for command in quick_start_commands():
            command = command.replace("REGISTRY", REGISTRY).replace("TRAINING-NAMESPACE", TRAINING_NAMESPACE)
            if command.startswith("make image"):
                assert f"make image IMAGE={REGISTRY}/mtc-agent:{VERSION}" in command, command
                continue
            if command.startswith("helm install"):
                command = " ".join([command, *STAND_IN_VALUES])
            if command.startswith("kubectl label namespace " + TRAINING_NAMESPACE):
                self.sh(f"kubectl create namespace {TRAINING_NAMESPACE}")
            self.sh(command, timeout=600)
            ran.append(command)
        return ran

    def lose_node(self, node: DeployNode) -> None:
        """``node`` fails (``DeployNode.lose``) and its Node object is deleted, as the cloud provider does with a
        vanished machine."""
        node.lose()
        self.client().delete(Node, node.name)
        self.nodes.remove(node)
        self.lost.append(node)

    def stop_nodes(self) -> None:
        for node in [*self.nodes, *self.lost]:
            node.stop()

    def add_node(self) -> DeployNode:
        """A fresh node (the next address and pod subnet) joins the cluster, started and Ready."""
        index, self._node_count = self._node_count, self._node_count + 1
        node = DeployNode(self.plane, node_address(index), pod_cidr(index), self.archives)
        self.nodes.append(node)
        return node.start(timeout_seconds=300)
