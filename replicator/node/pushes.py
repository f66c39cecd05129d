"""Pushes: carries out the coordinator's replicate orders, one committed step to one peer at a time.

The peer verifies every checksum before the replica becomes visible (``replicator.peer_tier.client.push_step``).
A push is not repeated while one is running, and per job and peer at most one starts per
``min_interval_seconds``. An order repeated soon after its push succeeded is first checked against the
target's manifest: the coordinator learns of a push only from the target's next report, so a repeat
is usually an order made before it; but the target may also have lost the copy (given up under
pressure, or a restart), and then the round waits on this push. The coordinator orders one step per
replication round (``coordinator/copies/replicas.py``), so a job saving faster replicates only its rounds' steps.
"""

import asyncio
import logging
import time
from collections.abc import Mapping

import aiohttp
from prometheus_client import Counter

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier.job_keys import BusySteps
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.log_once import LogOnce
from replicator.pacing import timing
from replicator.pacing.cpu_share import CpuShare
from replicator.peer_tier.client import PeerFetchError, UnusablePeerCopy, fetch_manifest, push_step
from replicator.wire.bearer import Tokens
from replicator.wire.messages import JobRef, ReplicateOrder, Target

log = logging.getLogger(__name__)

REPLICATED = Counter("mtc_replicated_steps_total", "Steps pushed to a peer", ["result"])
REPLICATED_BYTES = Counter("mtc_replicated_bytes_total", "Bytes of step data pushed to peers")
for _label in ("ok", "failed"):
    REPLICATED.labels(_label)


class Pusher:
    """The node's pushes of its steps to peers.

    Args:
      peer_token: bearer tokens of the peer tier (the current one is sent).
      share: the CPU cap of pushes while jobs train, or None.
      busy_steps: the steps being read; a push marks its step so GC keeps it.
      log_once: the agent's throttled error log.
      min_interval_seconds: at most one push per job and peer this often.
    """

    def __init__(
        self,
        peer_token: Tokens,
        share: CpuShare | None,
        busy_steps: BusySteps,
        log_once: LogOnce,
        min_interval_seconds: float = timing.MIN_PUSH_INTERVAL_SECONDS,
    ):
        self._peer_token = peer_token
        self._share = share
        self._busy_steps = busy_steps
        self._log_once = log_once
        self._min_interval_seconds = min_interval_seconds
        self._pushes: dict[tuple[JobRef, int, int, str], asyncio.Task] = {}  # (job, rank, step, target) -> its push
        self._pushed: dict[tuple[JobRef, int, int, str], float] = {}  # push key -> when it succeeded
        self._push_started: dict[tuple[JobRef, str], float] = {}  # (job, target) -> monotonic

    def tasks(self) -> list[asyncio.Task]:
        """The pushes started (to cancel them at shutdown)."""
        return list(self._pushes.values())

    def start(self, session: aiohttp.ClientSession, disks: Mapping[JobRef, Ramdisk], order: ReplicateOrder) -> None:
        """Starts the order's pushes that are due, in the background over the peer ``session``."""
        job = JobRef(order.namespace, order.job)
        disk = disks.get(job)
        if disk is None:
            return
        now = time.monotonic()
        self._pushes = {k: t for k, t in self._pushes.items() if not t.done()}
        self._pushed = {k: t for k, t in self._pushed.items() if now - t < timing.PUSH_REPEAT_SECONDS}
        for target in order.targets:
            key = (job, order.rank, order.step, target.node)
            lane = (job, target.node)
            if key in self._pushes or now - self._push_started.get(lane, -1e9) < self._min_interval_seconds:
                continue
            self._push_started[lane] = now
            self._pushes[key] = asyncio.create_task(
                self._push(session, job, disk, order, target, key, key in self._pushed)
            )

    async def _push(
        self,
        session: aiohttp.ClientSession,
        job: JobRef,
        disk: Ramdisk,
        order: ReplicateOrder,
        target: Target,
        key: tuple[JobRef, int, int, str],
        repeated: bool,
    ) -> None:
        """Pushes one committed step to one peer; the peer verifies it before it becomes visible. A
        ``repeated`` push is skipped when the peer still holds the same manifest."""
        meta = JobMeta(disk.path)
        located = meta.locate(order.rank, order.step)
        if located is None:
            return
        started = time.monotonic()
        with self._busy_steps.reading(job, order.step):
            try:
                step_dir, manifest = located
                if repeated and await self._still_held(session, job, target, manifest):
                    self._pushed[key] = time.monotonic()
                    return
                await push_step(
                    session,
                    target.url,
                    self._peer_token.current,
                    job.namespace,
                    job.job,
                    step_dir,
                    manifest,
                    share=self._share,
                    grant=target.grant,
                )
                REPLICATED.labels("ok").inc()
                REPLICATED_BYTES.inc(manifest.total_bytes)
                self._pushed[key] = time.monotonic()
                log.info(
                    "%s: replicated step %d of rank %d to %s in %.2f s (%d bytes)",
                    job,
                    order.step,
                    order.rank,
                    target.node,
                    time.monotonic() - started,
                    manifest.total_bytes,
                )
            except (TimeoutError, PeerFetchError, OSError, aiohttp.ClientError) as err:
                REPLICATED.labels("failed").inc()
                self._log_once(f"push-{target.node}", f"replicating step {order.step} to {target.node} failed: {err}")

    async def _still_held(self, session: aiohttp.ClientSession, job: JobRef, target: Target, manifest) -> bool:
        """Whether ``target`` holds ``manifest``'s rank and step with the same files.

        Raises:
          PeerFetchError: the target could not say (not reached, or an error other than 404/410).
        """
        try:
            held = await fetch_manifest(
                session,
                target.url,
                self._peer_token.current,
                job.namespace,
                job.job,
                manifest.rank,
                manifest.step,
                target.grant,
            )
        except UnusablePeerCopy:
            log.info(
                "%s: %s no longer holds rank %d step %d: pushing it again",
                job,
                target.node,
                manifest.rank,
                manifest.step,
            )
            return False
        return held.files == manifest.files
