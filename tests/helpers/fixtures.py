"""The fixtures of every layer (``tests/conftest.py`` registers this module): real node agents,
clusters and object stores on loopback, always stopped with their mounts; a peer service in the
test's own event loop."""

import asyncio.sslproto
import dataclasses
from collections.abc import Callable

import aiohttp
import pytest

from examples.local_cluster import LocalCluster, NodeAgentProcess, unmount_all_below
from replicator.coordinator.api.tls_read_buffer import share_tls_read_buffer
from tests.helpers.jobs import kill_started_jobs
from tests.helpers.peer import Peer, serve_peer
from tests.helpers.ports import listen_address
from tests.helpers.releases import PREVIOUS_RELEASE, release_tree
from tests.helpers.servers import FakeGcsServer, MinioServer, ServerProcess
from tests.helpers.tools import require_tool


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
        agent = NodeAgentProcess(node_id, str(tmp_path / node_id), listen_address(), backend, extra_args or [])
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        agent.stop()
    unmount_all_below(str(tmp_path))


@pytest.fixture
def start_cluster(tmp_path):
    """Factory: ``start_cluster(nodes=4, replicas=1, peer_tier=True, backup=None, env=None, peer_grants=False,
    agent_args=None)`` -> a running Cluster, always stopped."""
    clusters = []

    def start(
        nodes: int = 4,
        replicas: int = 1,
        peer_tier: bool = True,
        backup: str | None = None,
        env=None,
        peer_grants: bool = False,
        agent_args: list[str] | None = None,
    ) -> LocalCluster:
        cluster = LocalCluster(
            str(tmp_path),
            listen_address,
            replicas,
            peer_tier,
            backup,
            env,
            agent_args=agent_args,
            peer_grants=peer_grants,
        )
        clusters.append(cluster)
        return cluster.start(nodes)

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory) -> str:
    """The source tree of the previous release (``tests/helpers/releases.py``), extracted once per run."""
    version, commit = PREVIOUS_RELEASE
    return release_tree(commit, str(tmp_path_factory.mktemp(f"release-{version}")))


@pytest.fixture
def cluster(start_cluster):
    """A coordinator and four node agents (two topology blocks), ramdisk tier only."""
    started = start_cluster(peer_tier=False)
    return started.coordinator, started.agents


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
        return ObjectServer(
            server,
            "gs://ckpt/mtc",
            {"STORAGE_EMULATOR_HOST": server.url},
            lambda key, data: bucket.blob(key).upload_from_string(data),
            lambda prefix: [b.name for b in bucket.list_blobs(prefix=prefix)],
        )
    server = request.getfixturevalue("minio")
    client = server.client()
    return ObjectServer(
        server,
        "s3://ckpt/mtc",
        server.client_env(),
        lambda key, data: client.put_object(Bucket="ckpt", Key=key, Body=data),
        lambda prefix: [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix=prefix).get("Contents", [])],
    )


@pytest.fixture
async def serve():
    """Factory: ``await serve(ramdisk, **serve_peer's options)`` -> a Peer serving job NS/JOB from ``ramdisk``;
    always stopped."""
    runners = []

    async def start(ramdisk: str, **options) -> Peer:
        peer, runner = await serve_peer(ramdisk, **options)
        runners.append(runner)
        return peer

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def peer(serve, tmp_path) -> Peer:
    """A peer service whose job lives in ``tmp_path/ramdisk``."""
    return await serve(str(tmp_path / "ramdisk"))


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
def tls_buffer_sharing():
    """``share_tls_read_buffer`` applied to this process, undone afterwards."""
    protocol = asyncio.sslproto.SSLProtocol
    before = protocol.max_size, protocol.__init__
    yield share_tls_read_buffer
    protocol.max_size, protocol.__init__ = before
