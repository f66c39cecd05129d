"""Reading a parity group's pieces over the peer tier: ranges of a member's step stream, and parity shards."""

import asyncio
import dataclasses
import ssl
from collections.abc import Mapping

import aiohttp

from replicator.parity.layout import Files, stream_bytes, stream_pieces
from replicator.peer_tier.client import RangeReads, UnusablePeerCopy, fetch_manifest, file_url, shard_url
from replicator.wire.messages import MemberCopy, ShardCopy
from replicator.wire.redundancy import files_digest


@dataclasses.dataclass(frozen=True)
class StepReads:
    """Reads of one job's step from its group's nodes: manifests over ``session``, data on worker threads
    (``ranges``), with the peer ``token`` and, for ``https://`` peers, ``ssl_context``."""

    session: aiohttp.ClientSession
    token: str
    namespace: str
    job: str
    step: int
    ssl_context: ssl.SSLContext | None = None

    def ranges(self) -> RangeReads:
        """A new pool of range reads for the data (the caller closes it once no read runs)."""
        return RangeReads(self.token, self.ssl_context)


class MemberStream:
    """A member's step as one stream (``replicator.parity.layout``), read from the node holding it: its files
    as that node's manifest lists them (``open``)."""

    def __init__(self, grant: str | None, urls: Mapping[str, str], files: Files):
        self._grant, self._urls, self._files = grant, urls, files

    @classmethod
    async def open(cls, reads: StepReads, member: MemberCopy, expected_bytes: int) -> "MemberStream":
        """The member's stream on ``member.node``.

        Raises:
          PeerFetchError: the node could not say; ``UnusablePeerCopy`` when its step is not the length the
            parity was built over (another version of the step).
        """
        assert member.url is not None  # a member read from a node: the caller checks it has one
        manifest = await fetch_manifest(
            reads.session, member.url, reads.token, reads.namespace, reads.job, member.rank, reads.step, member.grant
        )
        if (held := stream_bytes(manifest.files)) != expected_bytes or (
            member.digest is not None and files_digest(manifest.files) != member.digest
        ):
            raise UnusablePeerCopy(
                f"rank {member.rank} step {reads.step} on {member.node} ({held} bytes) is not the version"
                f" its group's parity is built over ({expected_bytes} bytes)"
            )
        urls = {
            rel: file_url(member.url, reads.namespace, reads.job, member.rank, reads.step, rel)
            for rel in manifest.files
        }
        return cls(member.grant, urls, manifest.files)

    def read_into(self, ranges: RangeReads, start: int, into: memoryview) -> None:
        """Reads stream bytes ``[start, start + len(into))`` into ``into`` through ``ranges``; past the stream's
        end, zeros (the group's padding). Blocks: call it on a worker thread.

        Raises:
          PeerFetchError: a range could not be read.
        """
        at = 0
        for rel, offset, size in stream_pieces(self._files, start, len(into)):  # in stream order, back to back
            ranges.read_into(self._urls[rel], offset, into[at : at + size], self._grant)
            at += size
        into[at:] = bytes(len(into) - at)  # a reused buffer holds the last chunk's bytes there


class ShardStream:
    """A parity shard of the group whose first member is ``group``, on the node holding it."""

    def __init__(self, reads: StepReads, group: int, shard: ShardCopy):
        self._grant = shard.grant
        self._url = shard_url(shard.url, reads.namespace, reads.job, group, reads.step, shard.stripe)

    def read_into(self, ranges: RangeReads, start: int, into: memoryview) -> None:
        """Reads shard bytes ``[start, start + len(into))`` into ``into`` through ``ranges`` (blocks: call it on a
        worker thread; ``PeerFetchError`` when it cannot)."""
        ranges.read_into(self._url, start, into, self._grant)


async def open_members(
    reads: StepReads, members: Mapping[int, MemberCopy], stream_bytes_of: Mapping[int, int]
) -> dict[int, MemberStream]:
    """``MemberStream.open`` for each position of ``members``, at once."""
    positions = sorted(members)
    opened = await asyncio.gather(*(MemberStream.open(reads, members[p], stream_bytes_of[p]) for p in positions))
    return dict(zip(positions, opened))
