"""Fixtures that start real node agents on loopback and always stop them and their mounts."""

import itertools
import os

import pytest

from examples.local_cluster import CoordinatorProcess, NodeAgentProcess, can_mount_tmpfs, unmount_all_below

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
def cluster(tmp_path):
    """A coordinator and four node agents on 127.0.0.1-4 (two topology blocks), all real processes."""
    coordinator = CoordinatorProcess(str(tmp_path / "coordinator"), free_listen_address()).start()
    agents = [
        NodeAgentProcess(
            f"node-{i}",
            str(tmp_path / f"node-{i}"),
            free_listen_address(f"127.0.0.{i + 1}"),
            "tmpfs" if can_mount_tmpfs() else "dir",
            ["--coordinator", coordinator.url, "--pod-address", f"127.0.0.{i + 1}", "--topology", f"block=b{i // 2}"],
        ).start()
        for i in range(4)
    ]
    yield coordinator, agents
    for process in [*agents, coordinator]:
        process.stop()
    unmount_all_below(str(tmp_path))
