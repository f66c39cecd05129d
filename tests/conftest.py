"""Fixtures that start real node agents on loopback and always stop them and their mounts."""

import itertools
import os

import pytest

from examples.local_cluster import NodeAgentProcess, can_mount_tmpfs, unmount_all_below

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
