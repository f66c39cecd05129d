"""The restore path of one pod: plan -> sources in order -> fetch -> verify -> stage -> marker.

The coordinator's restore view names the agreed step and this rank's sources, fastest first (this
node, a peer, the backup tier). ``Restorer.restore`` stages the step from the first source that
serves a copy matching the owner's checksums, reports the outcome, waits (long poll) until every
rank has staged, then ``hand_over`` writes the job's restore marker. Within the deadline an unreachable
source is retried; only a proven mismatch gives a copy up (reported, so the plan moves on). The
restore's states and the transitions between them are ``restore_states``; this module does their I/O.
Each tier's copy is staged by its stager (``prefetch.stagers``: this node, a peer, a parity rebuild, the
backup tier), the first that serves the source.

Read-once restores: when the step is held only in the backup tier, a view may say an identical
rank's node is downloading it (``fan_out_pending``); the rank then waits (long poll) for the view
that lists that node first, and reads the store itself after ``fan_out_wait_seconds`` or as soon as
the coordinator sees that node silent.
"""

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from prometheus_client import Counter, Histogram

from csi_driver.ramdisk import Ramdisk
from prefetch import resharded, restore_states, staging
from prefetch.restore_states import Acting, Asking, Attempts, HandingOver, Reporting, Retrying, Staged, Staging, State
from prefetch.stagers.base import StageContext, Stager, Unreachable
from replicator.local_tier import space
from replicator.local_tier.in_flight import InFlight
from replicator.local_tier.job_keys import BusySteps, job_of
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import LogOnce, report_to_job
from replicator.local_tier.step_manifest import CorruptCopy, UnusableCopy
from replicator.local_tier.steps import drop_abandoned
from replicator.pacing import timing
from replicator.wire.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from replicator.wire.messages import PodRank, Source, Tier
from replicator.wire.metric_labels import JOB_LABELS

log = logging.getLogger(__name__)

# Buckets up to Orbax's 300 s wait for the marker; 150 s (half of it) is an alert threshold.
RESTORE_SECONDS = Histogram(
    "mtc_restore_seconds",
    "Seconds from replicator.yaml consumed to restore marker written (source timeout: no marker within the deadline)",
    ["source", *JOB_LABELS],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 150, 270, 300),
)
CORRUPT_COPIES = Counter("mtc_corrupt_copies_total", "Step copies that failed checksum verification")
# The copies being fetched from a peer or the backup tier (not staged in place from this node).
RESTORE_IN_FLIGHT = InFlight("mtc_restore", "fetched", "restores")
# The ``source`` label: the tier a restore staged from (``Tier``'s values), or one of these.
NO_SOURCE = "none"  # nothing to restore: the job starts fresh
TIMED_OUT = "timeout"  # no marker within the deadline
SOURCES = (*Tier, NO_SOURCE, TIMED_OUT)


def seed_job_series(namespace: str, job: str) -> None:
    """Creates the job's restore series at zero (at publish, before its restore), so rates and alerts
    count its first restore: Prometheus sees no increase in a series that starts at 1."""
    for source in SOURCES:
        RESTORE_SECONDS.labels(source, namespace, job)
    RESTORE_IN_FLIGHT.seed(namespace, job)


def forget_job_series(namespace: str, job: str) -> None:
    """Removes the job's restore series (its ramdisk left the node)."""
    for source in SOURCES:
        with contextlib.suppress(KeyError):
            RESTORE_SECONDS.remove(source, namespace, job)
    RESTORE_IN_FLIGHT.forget(namespace, job)


# (ramdisk, bytes wanted free) -> None: gives up unsafe copies to make room (``space.make_room`` with the
# job's latest retain order). ``RoomKeeper.make_room``.
MakeRoom = Callable[[Ramdisk, int], None]


def _rank(progress: PodProgress) -> int:
    """The pod's rank: it comes with the job's settings, before any restore begins."""
    assert progress.rank is not None
    return progress.rank


@dataclasses.dataclass(frozen=True)
class _PodRestore:
    """One pod's restore: what the actions of its states use."""

    client: CoordinatorClient
    session: aiohttp.ClientSession  # the peer session (fetches of manifests)
    disk: Ramdisk
    meta: JobMeta
    progress: PodProgress
    pod_rank: PodRank


class Restorer:
    """Runs the restores of the node's pods.

    Args:
      stagers: where a copy is staged from, asked in order (``prefetch.stagers.for_node``).
      log_once: the agent's throttled error log.
      deadline_seconds: a restore gives up (and tells the job) after this long; below Orbax's 300 s.
      make_room: called before a copy is fetched into a ramdisk without room for it, or None.
      fan_out_wait_seconds: how long a rank waits for an identical rank's node to download the step
        from the backup tier before it reads the store itself.
      busy_steps: told each step a restore view names, so that garbage collection by an order from before the
        view keeps it (``collect_garbage``); None in tests without garbage collection.
    """

    def __init__(
        self,
        stagers: Sequence[Stager],
        log_once: LogOnce,
        deadline_seconds: float = timing.RESTORE_DEADLINE_SECONDS,
        make_room: MakeRoom | None = None,
        fan_out_wait_seconds: float = timing.FAN_OUT_WAIT_SECONDS,
        busy_steps: BusySteps | None = None,
    ):
        self._stagers = tuple(stagers)
        self._make_room = make_room
        self._log_once = log_once
        self._deadline_seconds = deadline_seconds
        self._fan_out_wait_seconds = fan_out_wait_seconds
        self._busy_steps = busy_steps

    async def restore(
        self,
        client: CoordinatorClient,
        session: aiohttp.ClientSession,
        disk: Ramdisk,
        meta: JobMeta,
        progress: PodProgress,
        beat: Callable[[], None],
    ) -> None:
        """Restores the pod's agreed step and writes its marker, or tells the job it could not.

        Runs the restore's states (``restore_states``) until it hands over or its deadline passes.

        Args:
          session: the peer session (fetches of manifests).
          beat: called each time the restore asks the coordinator: the job's loop is alive while it waits.
        """
        if progress.handing_over is not None:  # staged and agreed before a crash: finish the hand-over only
            await asyncio.to_thread(
                hand_over, disk, meta, progress, None if progress.handing_over < 0 else progress.handing_over, "resumed"
            )
            return
        started, pod = (
            time.monotonic(),
            _PodRestore(client, session, disk, meta, progress, progress.pod_rank(job_of(disk))),
        )
        # A state machine, not a tenacity retry: every ask re-reads the plan (it may have changed while this
        # rank waited), and the backoff applies only while the plan's sources are unreachable.
        attempts = Attempts()
        state: State = Asking()
        while not isinstance(state, HandingOver):
            if isinstance(state, Asking):
                if time.monotonic() - started >= self._deadline_seconds:
                    RESTORE_SECONDS.labels(TIMED_OUT, disk.namespace, disk.job).observe(time.monotonic() - started)
                    report_to_job(meta, f"restore did not complete within {self._deadline_seconds:.0f} s")
                    return
                beat()
            try:
                attempts, state = await self._act(pod, attempts, state)
            except CoordinatorUnavailable as err:
                self._log_once(f"restore-{disk.job}", f"restore plan unavailable, retrying: {err}", meta)
                await asyncio.sleep(timing.RESTORE_PLAN_RETRY_SECONDS)
                state = restore_states.unavailable(state)
        view, source = state.view, attempts.used.tier if attempts.used else NO_SOURCE
        await asyncio.to_thread(hand_over, disk, meta, progress, view.step, source, view.forks, not view.rollback)
        RESTORE_SECONDS.labels(source, disk.namespace, disk.job).observe(time.monotonic() - started)

    async def _act(self, pod: _PodRestore, attempts: Attempts, state: Acting) -> tuple[Attempts, State]:
        """Does what ``state`` asks, then takes the transition named for its result.

        Raises:
          CoordinatorUnavailable: the coordinator did not answer the call the state made.
        """
        disk, meta, rank = pod.disk, pod.meta, pod.pod_rank.rank
        match state:
            case Asking(seen, wait):
                view = await pod.client.restore_view(pod.pod_rank, seen, wait)
                if self._busy_steps is not None and view.step is not None:
                    self._busy_steps.restoring(job_of(disk), view.step)
                return restore_states.viewed(attempts, view, time.monotonic(), self._fan_out_wait_seconds)
            case Staging(view, downloader_late):
                if downloader_late:
                    log.warning(
                        "%s/%s rank %d: step %d not downloaded by the identical rank's node within %.0f s; reading "
                        "the backup tier",
                        disk.namespace,
                        disk.job,
                        rank,
                        view.step,
                        self._fan_out_wait_seconds,
                    )
                staged = await self._stage(StageContext(pod.session, disk, meta, pod.progress, view), attempts.unusable)
                return restore_states.staged(attempts, view, staged)
            case Retrying(view, staged):
                if staged.bad:
                    await pod.client.report_staged(pod.pod_rank, view.generation, None, staged.bad, retrying=True)
                self._log_once(
                    f"restore-retry-{disk.job}",
                    f"step {view.step}: sources unreachable "
                    f"({'; '.join(staged.unreachable[:3])}); retrying in {attempts.backoff:.0f} s",
                    meta,
                )
                return restore_states.retried(attempts, view)
            case Reporting(view, staged):
                used = staged.source
                summary = staged.summary or (f"{used.tier}:{used.holder}" if used else None)
                await pod.client.report_staged(pod.pod_rank, view.generation, summary, staged.bad)
                return restore_states.reported(attempts, view)

    async def _stage(self, ctx: StageContext, unusable: frozenset[tuple[str, str, int]]) -> Staged:
        """Stages the view's step from its first source that serves a verified copy; an elastic
        restore's (``view.saved_nodes``) stages each old node's copy so (``resharded.stage_parts``).

        Args:
          unusable: (generation, holder, data rank) already proven unusable: not tried again.
        """
        view, meta = ctx.view, ctx.meta
        if view.saved_nodes is None:
            return await self._stage_sources(ctx, view.sources, unusable)

        def stage_one(sources: tuple[Source, ...], part: str) -> Awaitable[Staged]:
            return self._stage_sources(dataclasses.replace(ctx, part=part), sources, unusable)

        return await resharded.stage_parts(meta.framework, ctx.disk.client_dir, meta, view, stage_one)

    async def _stage_sources(
        self, ctx: StageContext, sources: tuple[Source, ...], unusable: frozenset[tuple[str, str, int]]
    ) -> Staged:
        """Stages one copy of the view's step from the first of ``sources`` that serves it verified:
        as the rank's step, or into ``ctx.part`` (an old node's copy of an elastic restore)."""
        disk, view, part = ctx.disk, ctx.view, ctx.part
        bad: list[tuple[int, int, str]] = []
        unreachable: list[str] = []
        for source in sources:
            if (view.generation, source.holder, source.data_rank) in unusable:
                continue
            try:
                await self._stage_from(ctx, source)
            except Unreachable as err:
                unreachable.append(f"{source.holder}: {err}")
                continue
            except UnusableCopy as err:
                if isinstance(err, CorruptCopy):
                    CORRUPT_COPIES.inc()
                message = f"step {view.step} copy on {source.holder} unusable: {err}"
                log.error("%s/%s rank %d: %s", disk.namespace, disk.job, ctx.rank, message)
                report_to_job(ctx.meta, message)
                bad.append((ctx.step, source.data_rank, source.holder))
                continue
            log.info(
                "%s/%s rank %d: staged step %d from %s %s (data of rank %d%s)",
                disk.namespace,
                disk.job,
                ctx.rank,
                ctx.step,
                source.tier,
                source.holder,
                source.data_rank,
                f", files {sorted(source.files or ())} as {os.path.basename(part)}" if part else "",
            )
            return Staged(source, bad, unreachable)
        return Staged(None, bad, unreachable)

    async def _stage_from(self, ctx: StageContext, source: Source) -> None:
        """Stages the view's step from ``source`` with the first stager that serves it, into ``ctx.part``
        when given (``_stage_sources``); a fetched copy gets room first and counts in flight.

        Raises:
          UnusableCopy: the copy is proven unusable (``CorruptCopy``: it fails its checksums).
          Unreachable: the source did not serve for now.
        """
        if source.files is not None and (missing := ctx.meta.framework.missing_commit_evidence(source.files)):
            raise UnusableCopy(f"its checksums lack {missing}")
        stager = next(stager for stager in self._stagers if stager.serves(ctx, source))
        if not stager.fetches:
            await stager.stage(ctx, source, lambda _: None)
            return
        need = sum(size for size, _ in source.files.values()) if source.files is not None else 0
        if source.files is not None:
            await asyncio.to_thread(self._room_for, ctx.disk, ctx.step, need)
        with RESTORE_IN_FLIGHT.transfer(ctx.disk.namespace, ctx.disk.job, need) as fetched:
            await stager.stage(ctx, source, fetched)

    def _room_for(self, disk: Ramdisk, step: int, need: int) -> None:
        """Makes room for a fetched copy of ``need`` bytes, giving up unsafe copies if it must.

        Raises:
          Unreachable: it does not fit even so (tried again: GC or a restore elsewhere may free space).
        """
        if space.free_bytes(disk.path) < need and self._make_room is not None:
            self._make_room(disk, need)
        if (free := space.free_bytes(disk.path)) < need:
            raise Unreachable(
                f"step {step} ({need} bytes) does not fit, not fetched: {free} bytes free; {space.describe_use(disk)}"
            )


def hand_over(
    disk: Ramdisk,
    meta: JobMeta,
    progress: PodProgress,
    step: int | None,
    source: str,
    forks: tuple[int, ...] = (),
    set_aside: bool = True,
) -> None:
    """Records the job's timeline (``forks``: training after the marker writes in it), sets aside
    steps newer than the agreed one (deletes them for a rollback: ``set_aside`` False) and writes
    the marker. Idempotent: replayed after a crash (``handing_over`` recorded, ``restore_done``
    not), it never clears again, since training may have saved steps since, and writes the marker
    only if the job has not taken it. An elastic restore's step is the one staged under
    ``resharded_name(step)`` (``prefetch.resharded``)."""
    if meta.learn_lineage(forks):
        drop_abandoned(disk)
    framework = meta.framework
    elastic = step is not None and os.path.isdir(os.path.join(disk.client_dir, framework.resharded_name(step)))
    if progress.handing_over is None:
        progress.handing_over = -1 if step is None else step
        meta.save_progress(progress)
        staging.clear_for_restore(framework, disk.client_dir, step, meta, _rank(progress), set_aside)
        resharded.drop_resharded(disk.client_dir, lambda other: elastic and other == step)
        marker_needed = True
    elif elastic:  # the marker, or the job's link after it renamed the marker, points at the resharded directory
        marker_needed = not resharded.linked(disk.client_dir, framework.resharded_name(step))  # type: ignore[arg-type]  # elastic: a step
    else:
        scan = framework.scan_steps(disk.client_dir)
        marker_needed = not scan.committed if step is None else step in scan.staged and step not in scan.committed
        log.warning(
            "%s/%s rank %d: resuming an interrupted hand-over of step %s (marker %s)",
            disk.namespace,
            disk.job,
            _rank(progress),
            step,
            "rewritten" if marker_needed else "already taken",
        )
    if marker_needed and step is None:
        framework.write_fresh_start_marker(disk.client_dir, disk.job, _rank(progress))
    elif marker_needed and step is not None:
        framework.write_restore_marker(disk.client_dir, disk.job, step, _rank(progress), elastic)
    progress.restore_done = True
    meta.save_progress(progress)
    log.info(
        "%s/%s rank %d: restore marker for step %s written (source %s)",
        disk.namespace,
        disk.job,
        _rank(progress),
        step,
        source,
    )
