"""A copy rebuilt from the rank's parity group (``replicator.parity.decoder``)."""

import ssl
from typing import ClassVar

from prefetch.stagers.base import Fetched, StageContext, fill_and_stage
from replicator.local_tier.step_manifest import StepManifest, UnusableCopy
from replicator.parity import decoder
from replicator.parity.reads import StepReads
from replicator.wire.bearer import Tokens
from replicator.wire.messages import Source, Tier


class ParityStager:
    """Rebuilds the view's step from the rank's parity group into the ramdisk, verified against the
    owner's checksums, then stages it."""

    fetches: ClassVar[bool] = True

    def __init__(self, peer_token: Tokens | None, peer_ssl: ssl.SSLContext | None):
        self._peer_token, self._peer_ssl = peer_token, peer_ssl

    def serves(self, ctx: StageContext, source: Source) -> bool:
        return source.tier == Tier.DECODE

    async def stage(self, ctx: StageContext, source: Source, fetched: Fetched) -> None:
        files, recipe = source.files, source.recipe
        if self._peer_token is None or recipe is None or files is None:
            raise UnusableCopy("a decode needs the peer tier, the group's recipe and the owner's checksums")
        token, step = self._peer_token.current, ctx.step

        async def fill(incoming: str) -> StepManifest:
            reads = StepReads(ctx.session, token, ctx.disk.namespace, ctx.disk.job, step, self._peer_ssl)
            await decoder.rebuild(reads, source.data_rank, files, recipe, incoming, fetched)
            return StepManifest(step, source.data_rank, dict(files))

        await fill_and_stage(ctx, fill)
