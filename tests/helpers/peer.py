"""A peer service (the node agent's peer routes) in the test's own event loop, serving one job."""

import dataclasses
import os

import yarl
from aiohttp import web

from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import StepManifest, build_manifest
from replicator.peer_tier.client import fetch_manifest, fetch_step
from replicator.peer_tier.grant_check import PeerGrants
from replicator.peer_tier.service import add_peer_routes
from replicator.wire.bearer import Tokens
from tests.helpers.steps import write_tree

TOKEN = "peer-secret-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NS, JOB = "default", "train"


@dataclasses.dataclass
class Peer:
    base_url: str
    meta: JobMeta

    def url(self, path: str) -> yarl.URL:
        """``path`` below the job's peer routes, sent exactly as written (no client-side normalising)."""
        return yarl.URL(f"{self.base_url}/v1/peer/jobs/{path}", encoded=True)

    def incoming(self) -> list[str]:
        return os.listdir(os.path.join(self.meta.root, "incoming"))


async def serve_peer(
    ramdisk: str, grants: PeerGrants | None = None, other_jobs: dict[tuple[str, str], str] | None = None
) -> tuple[Peer, web.AppRunner]:
    """Serves job NS/JOB from ``ramdisk`` (and ``other_jobs``: (namespace, job) -> ramdisk) on a free 127.0.0.1
    port, with ``grants`` checked where given; the caller cleans the runner up."""
    jobs = {(NS, JOB): ramdisk, **(other_jobs or {})}
    for path in jobs.values():
        os.makedirs(path, exist_ok=True)
    app = web.Application()
    add_peer_routes(app, lambda namespace, job: jobs.get((namespace, job)), Tokens.of(TOKEN), grants=grants)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return Peer(f"http://127.0.0.1:{runner.addresses[0][1]}", JobMeta(ramdisk)), runner


def commit_own_step(meta: JobMeta, step: int, rank: int, files: dict[str, bytes]) -> None:
    """A step the training pod committed on this node, with its manifest recorded."""
    step_dir = write_tree(os.path.join(meta.client_dir, str(step)), files)
    meta.save_manifest(build_manifest(step_dir, step, rank))


async def fetch(session, peer: Peer, rank: int, step: int, dest: str, **kwargs) -> StepManifest:
    """Fetches what the peer holds, verified against the manifest it serves."""
    manifest = await fetch_manifest(session, peer.base_url, TOKEN, NS, JOB, rank, step)
    await fetch_step(peer.base_url, TOKEN, NS, JOB, manifest, dest, **kwargs)
    return manifest
