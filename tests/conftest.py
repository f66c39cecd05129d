"""Fixtures that start real node agents on loopback and always stop them and their mounts."""

import itertools
import os

import pytest

from examples.local_cluster import (
    FakeGcsServer,
    LocalCluster,
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


@pytest.fixture
def start_cluster(tmp_path):
    """Factory: ``start_cluster(nodes=4, replicas=1, peer_tier=True, backup=None, env=None)`` -> a
    running Cluster, always stopped."""
    clusters = []

    def start(nodes: int = 4, replicas: int = 1, peer_tier: bool = True, backup: str | None = None, env=None) -> LocalCluster:
        cluster = LocalCluster(str(tmp_path), free_listen_address, replicas, peer_tier, backup, env)
        clusters.append(cluster)
        return cluster.start(nodes)

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
