"""Fixtures that start real node agents on loopback and always stop them and their mounts."""

import itertools
import os
import shutil

import pytest

from examples.local_cluster import (
    CoordinatorProcess,
    FakeGcsServer,
    NodeAgentProcess,
    can_mount_tmpfs,
    find_fake_gcs_server,
    unmount_all_below,
)

requires_root = pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting tmpfs needs root")

_ports = itertools.count(18470 + (os.getpid() % 500) * 20)


def free_listen_address(host: str = "127.0.0.1") -> str:
    """A HOST:PORT on loopback unlikely to collide with another test run."""
    return f"{host}:{next(_ports)}"


@pytest.fixture
def start_agent(tmp_path):
    """Factory: ``start_agent(node_id, backend="tmpfs", extra_args=[])`` -> a ready NodeAgentProcess."""
    agents: list[NodeAgentProcess] = []

    def start(node_id: str = "node-a", backend: str = "tmpfs", extra_args: list[str] | None = None) -> NodeAgentProcess:
        agent = NodeAgentProcess(node_id, str(tmp_path / node_id), free_listen_address(), backend, extra_args or [])
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        agent.stop()
    unmount_all_below(str(tmp_path))


class Cluster:
    """A coordinator and node agents on 127.0.0.x, each a real process.

    Node ``i`` listens on 127.0.0.<i+1> and sits in topology block ``b<i // 2>``.
    """

    def __init__(self, workdir, replicas: int = 1, peer_tier: bool = True, backup: str | None = None, env=None):
        self.workdir = workdir
        self.replicas = replicas
        self.peer_tier = peer_tier
        self.backup = backup
        self.env = env or {}
        self.token_file = workdir / "peer-token"
        self.token_file.write_text("test-peer-token-0123456789\n")
        self.coordinator = CoordinatorProcess(str(workdir / "coordinator"), free_listen_address(), ["--node-timeout-seconds", "4"])
        self.agents: list[NodeAgentProcess] = []

    def add_node(self, index: int, block: str | None = None) -> NodeAgentProcess:
        agent = NodeAgentProcess(
            f"node-{index}",
            str(self.workdir / f"node-{index}"),
            free_listen_address(f"127.0.0.{index + 1}"),
            "tmpfs" if can_mount_tmpfs() else "dir",
            ["--coordinator", self.coordinator.url, "--pod-address", f"127.0.0.{index + 1}",
             "--topology", f"block={block or f'b{index // 2}'}", "--replicas", str(self.replicas),
             *(["--peer-token-file", str(self.token_file)] if self.peer_tier else []),
             *(["--backup", self.backup] if self.backup else [])],
            env=self.env,
        )  # fmt: skip
        self.agents.append(agent)
        return agent.start()

    def lose_node(self, agent: NodeAgentProcess) -> None:
        """What a node failure does: the agent dies and the node's RAM (every ramdisk) is gone."""
        agent.kill()
        unmount_all_below(agent.workdir)
        shutil.rmtree(agent.workdir)

    def stop(self) -> None:
        for process in [*self.agents, self.coordinator]:
            process.stop()
        unmount_all_below(str(self.workdir))


@pytest.fixture
def start_cluster(tmp_path):
    """Factory: ``start_cluster(nodes=4, replicas=1, peer_tier=True, backup=None, env=None)`` -> a
    running Cluster, always stopped."""
    clusters = []

    def start(nodes: int = 4, replicas: int = 1, peer_tier: bool = True, backup: str | None = None, env=None) -> Cluster:
        cluster = Cluster(tmp_path, replicas, peer_tier, backup, env)
        clusters.append(cluster)
        cluster.coordinator.start()
        for index in range(nodes):
            cluster.add_node(index)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def cluster(start_cluster):
    """A coordinator and four node agents (two topology blocks), ramdisk tier only."""
    started = start_cluster(peer_tier=False)
    return started.coordinator, started.agents


@pytest.fixture
def fake_gcs(tmp_path):
    """A real fake-gcs-server with bucket ``ckpt``, objects on disk so a restart keeps them; always stopped."""
    binary = find_fake_gcs_server()
    if binary is None:
        pytest.fail("fake-gcs-server is neither on PATH nor in .tools/bin; run `make tools`")
    server = FakeGcsServer(binary, data_dir=str(tmp_path / "gcs-data")).start()
    server.client().create_bucket("ckpt")
    yield server
    server.stop()
