"""Reading a parity group's pieces over the peer tier: ranges of a member's step stream, and parity shards."""

import asyncio
from collections.abc import Mapping

import aiohttp

from replicator.parity.layout import Files, stream_bytes, stream_pieces
from replicator.peer_tier.client import UnusablePeerCopy, fetch_manifest, fetch_range, file_url, shard_url
from replicator.wire.messages import MemberCopy, ShardCopy


class MemberStream:
    """A member's step as one stream (``replicator.parity.layout``), read from the node holding it."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        token: str,
        namespace: str,
        job: str,
        step: int,
        member: MemberCopy,
        files: Files,
    ):
        assert member.url is not None  # a member read from a node: the caller checks it has one
        self._session, self._token, self._grant = session, token, member.grant
        self._urls = {rel: file_url(member.url, namespace, job, member.rank, step, rel) for rel in files}
        self._files = files

    @classmethod
    async def open(
        cls,
        session: aiohttp.ClientSession,
        token: str,
        namespace: str,
        job: str,
        step: int,
        member: MemberCopy,
        expected_bytes: int,
    ) -> "MemberStream":
        """The member's stream, its files from the manifest its node serves.

        Raises:
          PeerFetchError: the node could not say; ``UnusablePeerCopy`` when its step is not the length the
            parity was built over (another version of the step).
        """
        assert member.url is not None
        manifest = await fetch_manifest(session, member.url, token, namespace, job, member.rank, step, member.grant)
        if (held := stream_bytes(manifest.files)) != expected_bytes:
            raise UnusablePeerCopy(
                f"rank {member.rank} step {step} on {member.node} is {held} bytes, the parity was built over {expected_bytes}"
            )
        return cls(session, token, namespace, job, step, member, manifest.files)

    async def read(self, start: int, length: int) -> bytes:
        """Stream bytes ``[start, start + length)``; past the stream's end, zeros (the group's padding).

        Raises:
          PeerFetchError: a range could not be read.
        """
        out = bytearray(length)
        pieces = list(stream_pieces(self._files, start, length))
        bodies = await asyncio.gather(
            *(
                fetch_range(self._session, self._urls[rel], self._token, offset, size, self._grant)
                for rel, offset, size in pieces
            )
        )
        at = 0
        for (_, _, size), body in zip(pieces, bodies):
            out[at : at + size] = body
            at += size
        return bytes(out)


class ShardStream:
    """A parity shard on the node holding it."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        token: str,
        namespace: str,
        job: str,
        step: int,
        group: int,
        shard: ShardCopy,
    ):
        self._session, self._token, self._grant = session, token, shard.grant
        self._url = shard_url(shard.url, namespace, job, group, step, shard.stripe)

    async def read(self, start: int, length: int) -> bytes:
        return await fetch_range(self._session, self._url, self._token, start, length, self._grant)


async def open_members(
    session: aiohttp.ClientSession,
    token: str,
    namespace: str,
    job: str,
    step: int,
    members: Mapping[int, MemberCopy],
    stream_bytes_of: Mapping[int, int],
) -> dict[int, MemberStream]:
    """``MemberStream.open`` for each position of ``members``, at once."""
    positions = sorted(members)
    opened = await asyncio.gather(
        *(MemberStream.open(session, token, namespace, job, step, members[p], stream_bytes_of[p]) for p in positions)
    )
    return dict(zip(positions, opened))
