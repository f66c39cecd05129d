"""The protocol of a restore's stagers and what they share: the context of one copy and its install."""

import asyncio
import dataclasses
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import ClassVar, Protocol

import aiohttp

from csi_driver.ramdisk import Ramdisk
from prefetch import staging
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.step_manifest import CorruptCopy, StepManifest, UnusableCopy
from replicator.peer_tier.client import PeerFetchError
from replicator.wire.messages import RestoreView, Source

# Called with each range's bytes as it lands (``InFlight.transfer``).
Fetched = Callable[[int], None]


class Unreachable(Exception):
    """A source that did not serve for now (unreachable, or its tier failed): worth retrying."""


@dataclasses.dataclass(frozen=True)
class StageContext:
    """One copy of a view's step to stage: what every stager reads.

    Attributes:
      session: the peer session (fetches of manifests, reads of a parity group).
      disk: the job's ramdisk.
      meta: the job's metadata on it.
      progress: the pod's restore progress (its rank).
      view: the coordinator's restore view: the step and its timeline (``forks``).
      part: where an elastic restore stages an old node's copy (``prefetch.resharded``), or None to stage
        it as this rank's step.
    """

    session: aiohttp.ClientSession
    disk: Ramdisk
    meta: JobMeta
    progress: PodProgress
    view: RestoreView
    part: str | None = None

    @property
    def step(self) -> int:
        """The step the view stages: staging begins only for a view that has one."""
        assert self.view.step is not None
        return self.view.step

    @property
    def rank(self) -> int:
        """The pod's rank: it comes with the job's settings, before any restore begins."""
        assert self.progress.rank is not None
        return self.progress.rank


class Stager(Protocol):
    """Stages a source's copy of the view's step (``StageContext``).

    ``fetches``: the stager copies bytes into the ramdisk (the restorer makes room first and counts them
    in flight); False for a copy already on this node.
    """

    fetches: ClassVar[bool]

    def serves(self, ctx: StageContext, source: Source) -> bool:
        """Whether this stager stages ``source``."""
        ...

    async def stage(self, ctx: StageContext, source: Source, fetched: Fetched) -> None:
        """Stages ``source``'s copy, verified, as the rank's step or into ``ctx.part``.

        Args:
          fetched: called with each range's bytes as it lands.

        Raises:
          UnusableCopy: the copy is proven unusable (``CorruptCopy``: it fails its checksums).
          Unreachable: the source did not serve for now.
        """
        ...


def check_owner(manifest: StepManifest, source: Source) -> None:
    """Raises CorruptCopy when the checksums a copy was verified against are not those its owning
    rank reported (carried in the plan); the bytes were checked against ``manifest``, so equal
    manifests mean they match the owner's."""
    if source.files is not None and manifest.files != source.files:
        raise CorruptCopy(
            f"crc32c mismatch: the copy on {source.holder} does not match the checksums rank {source.data_rank} reported"
        )


async def install(ctx: StageContext, verified: str, manifest: StepManifest) -> None:
    """Stages a verified copy at ``verified``: this rank's copy of the step from then on, in the view's
    timeline; or, given ``ctx.part``, moves it there (an old node's copy, never this rank's)."""
    if ctx.part is not None:
        os.rename(verified, ctx.part)
        return
    await asyncio.to_thread(staging.install_staged, ctx.meta.framework, ctx.disk.client_dir, ctx.step, verified)
    # Recorded as this rank's step: from now on this node serves it for this rank.
    ctx.meta.save_manifest(dataclasses.replace(manifest, rank=ctx.rank, timeline=len(ctx.view.forks)))


async def fill_and_stage(ctx: StageContext, fill: Callable[[str], Awaitable[StepManifest]]) -> None:
    """Has ``fill`` write the view's step into a fresh incoming directory (it returns the manifest the bytes
    were verified against), then stages it (``install``). Raises as ``Stager.stage``."""
    incoming = ctx.meta.new_incoming_dir()
    try:
        manifest = await fill(incoming)
    except UnusableCopy:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    except (TimeoutError, PeerFetchError, OSError, aiohttp.ClientError) as err:
        shutil.rmtree(incoming, ignore_errors=True)
        raise Unreachable(str(err) or repr(err)) from err
    await install(ctx, incoming, manifest)
