"""A rank whose restore sources are unreachable waits for a new plan as a long poll, not a sleep.

A real ``Restorer`` against a real peer service on loopback; the coordinator's side is a stand-in that
answers ``restore_view`` as the service does (at once when the view differs from ``seen``, else when it
changes or ``wait`` seconds pass). The first plan names a holder nobody listens on; once the rank's
backoff has grown to seconds, the plan moves to a reachable peer, and the rank must stage from it at
once, not when its backoff ends. The stand-in's long polls run on a fake clock: a wait shorter than
``hold_from`` passes at once (the clock moves on by it), a longer one lasts until the plan changes; the
test asserts the waits the rank asked for and what ended each, without sleeping through them.
"""

import asyncio
import os
import socket

import aiohttp

from csi_driver.ramdisk import Ramdisk
from prefetch import stagers
from prefetch.restore import Restorer
from replicator.local_tier import frameworks
from replicator.local_tier.frameworks import orbax
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import LogOnce
from replicator.wire.bearer import Tokens
from replicator.wire.messages import RestoreView, Source, Tier
from tests.helpers.peer import JOB, NS, TOKEN, commit_own_step

RANK, STEP = 1, 7
FILES = {orbax.COMMIT_EVIDENCE: b"{}", "state/manifest.ocdbt": os.urandom(20_000)}


class LongPolledPlan:
    """The coordinator's restore views for one rank, long-polled like the service's, on a fake clock.

    Attributes:
      waits: the ``wait`` of each long poll the rank made, seconds.
      ended: what ended each: ``"timed out"`` (the fake clock moved on by ``wait``) or ``"replanned"``.
      clock: fake seconds passed in long polls.
    """

    def __init__(self, view: RestoreView, hold_from: float):
        self.view, self.changed, self.hold_from = view, asyncio.Event(), hold_from
        self.waits: list[float] = []
        self.ended: list[str] = []
        self.staged: list[tuple[str, str]] = []
        self.clock = 0.0

    def replan(self, view: RestoreView) -> None:
        self.view = view
        self.changed.set()

    async def restore_view(self, pod, seen=None, wait=None) -> RestoreView:
        if seen == self.view.token:
            self.waits.append(wait)
            self.changed.clear()
            if wait < self.hold_from:  # no change comes within it: the wait times out
                self.clock += wait
                self.ended.append("timed out")
            else:
                await self.changed.wait()
                self.ended.append("replanned")
        return self.view

    async def report_staged(self, pod, generation, source, bad, retrying=False) -> None:
        if not retrying:
            self.staged.append((generation, source))
            self.view = RestoreView(generation, STEP, self.view.sources, ready=True)
            self.changed.set()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


async def test_a_replan_ends_the_retry_backoff_at_once(serve, tmp_path):
    holder = await serve(str(tmp_path / "holder"))
    commit_own_step(holder.meta, STEP, RANK, FILES)
    files = holder.meta.manifests()[STEP].files
    disk = Ramdisk(NS, JOB, 1 << 20, str(tmp_path / "restorer"))
    os.makedirs(disk.client_dir)
    plan = LongPolledPlan(
        RestoreView("g1", STEP, (Source(Tier.PEER_CLOSE, "node-lost", closed_port_url(), RANK, files),), ready=False),
        hold_from=4.0,
    )
    async with aiohttp.ClientSession() as session:
        restorer = Restorer(stagers.for_node("node-a", Tokens.of(TOKEN), None, None), LogOnce(), deadline_seconds=60)
        restoring = asyncio.create_task(
            restorer.restore(plan, session, disk, JobMeta(disk.path), PodProgress("uid", "inc", RANK), lambda: None)
        )
        async with asyncio.timeout(30):  # a rank that slept through its backoff would never ask for the 4 s wait
            while 4.0 not in plan.waits:  # backoffs of 1 s and 2 s passed on the fake clock, the 4 s one begun
                await asyncio.sleep(0.01)
        plan.replan(
            RestoreView("g2", STEP, (Source(Tier.PEER_CLOSE, "node-b", holder.base_url, RANK, files),), ready=False)
        )
        await asyncio.wait_for(restoring, 30)

    assert plan.waits == [1.0, 2.0, 4.0]  # each backoff was a long poll on the failed plan's view, doubling
    assert plan.ended == ["timed out", "timed out", "replanned"]  # the new plan ended the 4 s backoff at once
    assert plan.clock == 3.0
    assert plan.staged == [("g2", "peer_close:node-b")]
    assert frameworks.get("orbax").scan_steps(disk.client_dir).staged == [STEP]
