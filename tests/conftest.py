"""Fixtures that start real node agents on loopback and always stop them and their mounts."""

import dataclasses
import itertools
import os
from collections.abc import Callable

import pytest

from examples.local_cluster import (
    FakeGcsServer,
    LocalCluster,
    MinioServer,
    NodeAgentProcess,
    ServerProcess,
    can_mount_tmpfs,
    find_tool,
    unmount_all_below,
)

from tests.jobs import kill_started_jobs

requires_root = pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting tmpfs needs root")

_ports = itertools.count(18470 + (os.getpid() % 500) * 20)


def free_listen_address(host: str = "127.0.0.1") -> str:
    """A HOST:PORT on loopback unlikely to collide with another test run."""
    return f"{host}:{next(_ports)}"


@pytest.fixture(autouse=True)
def no_trainer_outlives_its_test():
    """A test's training jobs are killed when it ends, passed or failed."""
    yield
    kill_started_jobs()


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


def require_tool(name: str) -> str:
    """The path of a Go tool ``make tools`` installs; fails the test when it is missing."""
    binary = find_tool(name)
    if binary is None:
        pytest.fail(f"{name} is neither on PATH nor in .tools/bin; run `make tools`")
    return binary


@pytest.fixture
def fake_gcs(tmp_path):
    """A real fake-gcs-server with bucket ``ckpt``, objects on disk so a restart keeps them; always stopped."""
    server = FakeGcsServer(require_tool("fake-gcs-server"), data_dir=str(tmp_path / "gcs-data")).start()
    server.client().create_bucket("ckpt")
    yield server
    server.stop()


@pytest.fixture
def minio(tmp_path):
    """A real MinIO server with bucket ``ckpt`` (objects on disk, so a restart keeps them); always stopped."""
    server = MinioServer(require_tool("minio"), str(tmp_path / "minio-data")).start()
    server.client().create_bucket(Bucket="ckpt")
    yield server
    server.stop()


@dataclasses.dataclass
class ObjectServer:
    """A real object store with bucket ``ckpt``, as the node agents' backup tier sees it.

    Attributes:
      server: the process (stop and start it for an outage; objects survive).
      backup_url: ``--backup`` for the agents, below the prefix ``mtc/``.
      env: the agents' environment for it.
      put: writes an object (a key in the bucket) directly, as an agent killed mid-upload would have.
      keys: the keys below a prefix.
    """

    server: ServerProcess
    backup_url: str
    env: dict[str, str]
    put: Callable[[str, bytes], None]
    keys: Callable[[str], list[str]]


@pytest.fixture(params=["gs", "s3"])
def object_server(request) -> ObjectServer:
    """The backup tier's store for end-to-end tests: fake-gcs-server (``gs://``) or MinIO (``s3://``)."""
    if request.param == "gs":
        server = request.getfixturevalue("fake_gcs")
        bucket = server.client().bucket("ckpt")
        return ObjectServer(server, "gs://ckpt/mtc", {"STORAGE_EMULATOR_HOST": server.url},
                            lambda key, data: bucket.blob(key).upload_from_string(data),
                            lambda prefix: [b.name for b in bucket.list_blobs(prefix=prefix)])  # fmt: skip
    server = request.getfixturevalue("minio")
    client = server.client()
    return ObjectServer(server, "s3://ckpt/mtc", server.client_env(),
                        lambda key, data: client.put_object(Bucket="ckpt", Key=key, Body=data),
                        lambda prefix: [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix=prefix).get("Contents", [])])  # fmt: skip
