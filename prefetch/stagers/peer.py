"""A peer's copy (or this node's own replica) pulled over the peer tier."""

import ssl
from typing import ClassVar

from prefetch.stagers.base import Fetched, StageContext, fill_and_stage
from replicator.local_tier.step_manifest import StepManifest, UnusableCopy
from replicator.peer_tier.client import fetch_manifest, fetch_step
from replicator.wire.bearer import Tokens
from replicator.wire.messages import Source


class PeerStager:
    """Pulls the view's step from a peer (or this node's own replica) into the ramdisk, verified, then
    stages it. Serves every source no other stager takes (``stagers.for_node``'s order)."""

    fetches: ClassVar[bool] = True

    def __init__(self, peer_token: Tokens | None, peer_ssl: ssl.SSLContext | None):
        self._peer_token = peer_token
        self._peer_ssl = peer_ssl

    def serves(self, ctx: StageContext, source: Source) -> bool:
        return True

    async def stage(self, ctx: StageContext, source: Source, fetched: Fetched) -> None:
        if self._peer_token is None or not source.url:
            raise UnusableCopy(f"peer tier unavailable for {source.holder}")
        token, url, step, disk = self._peer_token.current, source.url, ctx.step, ctx.disk

        async def fill(incoming: str) -> StepManifest:
            # Verified against the owner's checksums from the plan; the peer's own manifest only when the plan has none.
            manifest = (
                StepManifest(step, source.data_rank, dict(source.files))
                if source.files is not None
                else await fetch_manifest(
                    ctx.session, url, token, disk.namespace, disk.job, source.data_rank, step, source.grant
                )
            )
            await fetch_step(
                url,
                token,
                disk.namespace,
                disk.job,
                manifest,
                incoming,
                ssl_context=self._peer_ssl,
                on_range=fetched,
                grant=source.grant,
            )
            return manifest

        await fill_and_stage(ctx, fill)
