"""This node's own copy: the rank's step staged in place, or a copy held here linked into an elastic part."""

import asyncio
from typing import ClassVar

from prefetch import resharded, staging
from prefetch.stagers.base import Fetched, StageContext, check_owner
from replicator.local_tier.step_manifest import UnusableCopy
from replicator.wire.messages import Source


class LocalStager:
    """Stages a copy this node holds: the rank's own step in place, or (an elastic restore's part) this
    node's old step or a replica, by hard links. A replica of another rank staged as this rank's step
    goes over the peer tier (``PeerStager``)."""

    fetches: ClassVar[bool] = False

    def __init__(self, node_id: str):
        self.node_id = node_id

    def serves(self, ctx: StageContext, source: Source) -> bool:
        return source.holder == self.node_id and (ctx.part is not None or source.data_rank == ctx.rank)

    async def stage(self, ctx: StageContext, source: Source, fetched: Fetched) -> None:
        if ctx.part is not None:
            await asyncio.to_thread(_link_held, ctx, source, ctx.part)
            return
        meta = ctx.meta
        await asyncio.to_thread(
            staging.stage_local,
            meta.framework,
            ctx.disk.client_dir,
            ctx.step,
            meta.manifests().get(ctx.step),
            meta,
            ctx.rank,
        )


def _link_held(ctx: StageContext, source: Source, part: str) -> None:
    """Stages into ``part`` a copy held on this node, this node's own old step or a replica,
    by hard links (``resharded.link_copy``), checked against the owner's checksums.

    Raises:
      UnusableCopy: the copy is not held here any more, or fails its checksums (``CorruptCopy``).
    """
    meta, step = ctx.meta, ctx.step
    found, manifest = None, meta.manifests().get(step)
    if manifest is not None and manifest.rank == source.data_rank:
        found = meta.framework.find_step_dir(ctx.disk.client_dir, step)
    elif (manifest := meta.replicas().get((source.data_rank, step))) is not None:
        found = meta.replica_dir(source.data_rank, step)
    if found is None or manifest is None:
        raise UnusableCopy(f"step {step} of rank {source.data_rank} is not held here")
    check_owner(manifest, source)
    resharded.link_copy(found, manifest, part, f"the copy of rank {source.data_rank}'s step {step} held here")
