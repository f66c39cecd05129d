"""Decoding: rebuilds a lost member's step from its group's survivors and parity shards (a ``Tier.DECODE``
source of the restore view), into an empty directory, checked against the owner's checksums.

Chunk by chunk, ``IN_FLIGHT`` chunks at a time: each chunk reads ``n - k`` of its stripe's other shards, members'
segments first (a read, no arithmetic), parity shards for the rest, and rebuilds the member's segment in place.
Each chunk runs on a worker thread: it reads its shards over the peer tier straight into a set of buffers
(``RangeReads``: socket reads with the GIL released, as a fetch's), rebuilds into them, and writes; the set is
reused by the chunks after it (``FreeBuffers``).
Every parity shard read is checked against the CRC-32C it was built with, and every rebuilt file against the
CRC-32C its owner reported (chunks' CRCs combined in order): a decode hands out nothing unverified.
"""

import asyncio
import errno
import functools
import os
import threading
from collections.abc import Callable, Mapping

from replicator.local_tier.incoming import pwrite_all
from replicator.local_tier.step_manifest import CorruptCopy, UnusableCopy, crc32c_combine, crc32c_extend, safe_relpath
from replicator.parity.buffers import ChunkBuffers, FreeBuffers
from replicator.parity.codec import Codec, codec
from replicator.parity.layout import Files, GroupLayout, stream_bytes, stream_pieces
from replicator.parity.reads import MemberStream, ShardStream, StepReads, open_members
from replicator.peer_tier.client import RangeReads, run_all
from replicator.wire.messages import ParityRecipe, ShardCopy

CHUNK_BYTES = 4 << 20
IN_FLIGHT = 4  # chunks being read and rebuilt at once: reads overlap the rebuilding, memory stays a few chunks

Readers = Mapping[int, tuple[MemberStream | ShardStream, int]]  # shard index -> (its reader, where it starts)


async def rebuild(
    reads: StepReads,
    rank: int,
    files: Files,
    recipe: ParityRecipe,
    dest_dir: str,
    on_range: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Rebuilds ``rank``'s step (``reads.step``) into ``dest_dir`` and checks every file against ``files``.

    Args:
      reads: the job's step and the peer session and token to read the group's pieces with.
      files: the owner's checksums (path -> (size, CRC-32C)).
      recipe: the group's members and live parity shards (the restore view's).
      dest_dir: an empty directory on the destination filesystem; holds partial data on error.
      on_range: called with the bytes of each rebuilt chunk, or None.

    Raises:
      UnusableCopy: the group cannot rebuild it (too many members lost, the rank not a member);
        ``CorruptCopy`` when a parity shard or the rebuilt step fails its checksums.
      PeerFetchError: a survivor or a shard holder could not be read (worth retrying).
      OSError: ``dest_dir`` could not be written.
    """
    layout, step = GroupLayout.of_group(recipe), reads.step
    if rank not in layout.members:
        raise UnusableCopy(f"rank {rank} is not a member of group {list(layout.members)}")
    position = layout.members.index(rank)
    if stream_bytes(files) != layout.stream_bytes[position]:
        raise UnusableCopy(f"the parity of rank {rank} step {step} was built over another version of it")
    live = {p: m for p, m in enumerate(recipe.members) if m.url is not None and p != position}
    shards = {(s.stripe, s.index): s for s in recipe.shards}
    plan = _plan(layout, position, set(live), set(shards))
    needed = {layout.contributors(s)[i] for s, chosen in plan.items() for i in chosen if i < layout.data}
    streams = await open_members(reads, {p: live[p] for p in needed}, dict(enumerate(layout.stream_bytes)))
    fds = _create_files(dest_dir, files)
    chunks = _Chunks(layout, position, files, codec(layout.data, layout.parity), fds, reads.ranges())
    readers = {stripe: _readers(layout, stripe, chosen, streams, reads, shards) for stripe, chosen in plan.items()}
    free = FreeBuffers(layout.data, 1, chunk_bytes)  # a set per chunk in flight, reused by the chunks after it

    async def chunk(stripe: int, offset: int) -> None:
        size = min(chunk_bytes, layout.segment_bytes - offset)
        written = await free.run(functools.partial(chunks.rebuild, stripe, offset, readers[stripe], size))
        if on_range is not None and written:
            on_range(written)

    offsets = range(0, layout.segment_bytes, chunk_bytes)
    try:
        await run_all([functools.partial(chunk, stripe, offset) for stripe in plan for offset in offsets], IN_FLIGHT)
    finally:
        await asyncio.to_thread(chunks.close)  # after the chunks a failure or a cancel left on their threads
    _verify(chunks, layout, shards, files, f"rank {rank} step {step}")


def _verify(
    chunks: "_Chunks", layout: GroupLayout, shards: Mapping[tuple[int, int], ShardCopy], files: Files, what: str
) -> None:
    """Raises CorruptCopy unless every parity shard read matches the CRC-32C it was built with and every rebuilt
    file the one its owner reported (``what``: the rank and step, for the message)."""
    for (stripe, i), crc in chunks.shard_crcs().items():
        shard = shards[(stripe, i - layout.data)]
        if shard.crc32c is not None and f"{crc:08x}" != shard.crc32c:
            raise CorruptCopy(f"parity shard {i - layout.data} of stripe {stripe} on {shard.node} fails its checksum")
    bad = sorted(rel for rel, crc in chunks.file_crcs().items() if f"{crc:08x}" != files[rel][1])
    if bad:
        raise CorruptCopy(
            f"{what} rebuilt from group {list(layout.members)} fails its checksums: " + ", ".join(bad[:5])
        )


def _plan(layout: GroupLayout, position: int, live: set[int], shards: set[tuple[int, int]]) -> dict[int, list[int]]:
    """stripe -> the ``n - k`` shard indices (data ``0 .. n-k-1``, then parity) its rebuild of ``position``'s
    segment reads: live members' segments first, then live parity shards (``shards``: (stripe, parity index)).

    Raises:
      UnusableCopy: a stripe has fewer than ``n - k`` of them.
    """
    plan = {}
    for stripe in layout.stripes_of(position):
        data = [i for i, p in enumerate(layout.contributors(stripe)) if p in live]
        parity = [layout.data + j for j in range(layout.parity) if (stripe, j) in shards]
        if len(data) + len(parity) < layout.data:
            raise UnusableCopy(
                f"stripe {stripe} of group {list(layout.members)} has {len(data) + len(parity)} of"
                f" the {layout.data} shards a rebuild needs"
            )
        plan[stripe] = (data + parity)[: layout.data]
    return plan


def _readers(
    layout: GroupLayout,
    stripe: int,
    chosen: list[int],
    streams: Mapping[int, MemberStream],
    reads: StepReads,
    shards: Mapping[tuple[int, int], ShardCopy],
) -> Readers:
    """Shard index -> (its reader, where the stripe's shard starts in what it reads, bytes) for ``chosen``."""
    readers: dict[int, tuple[MemberStream | ShardStream, int]] = {}
    for i in chosen:
        if i < layout.data:
            position = layout.contributors(stripe)[i]
            readers[i] = (streams[position], layout.data_offset(position, stripe))
        else:
            readers[i] = (ShardStream(reads, layout.members[0], shards[(stripe, i - layout.data)]), 0)
    return readers


class _Chunks:
    """One rebuild's chunks: each read, rebuilt and written in place on a worker thread, its CRC-32Cs kept by
    offset and combined in order at the end, so chunks may finish in any order (``crc32c_combine``, as a peer
    fetch does)."""

    def __init__(
        self, layout: GroupLayout, position: int, files: Files, code: Codec, fds: dict[str, int], ranges: RangeReads
    ):
        self._layout, self._position, self._files, self._code, self._fds = layout, position, files, code, fds
        self._ranges = ranges
        self._starts, at = {}, 0
        for rel in sorted(files):
            self._starts[rel], at = at, at + files[rel][0]
        self._pieces: dict[tuple[str, int], tuple[int, int]] = {}  # (file, offset) -> (CRC, bytes)
        self._shards: dict[tuple[int, int, int], tuple[int, int]] = {}  # (stripe, shard, offset) -> (CRC, bytes)
        # A cancelled chunk's thread runs on: descriptors and connections close once none reads or writes (a closed
        # number is reused).
        self._writing, self._closed = 0, False
        self._idle = threading.Condition()

    def rebuild(self, stripe: int, offset: int, readers: Readers, size: int, buffers: ChunkBuffers) -> int:
        """Reads ``size`` bytes at ``offset`` of each shard of ``readers`` into ``buffers.reads``, rebuilds the
        member's segment of ``stripe`` there into ``buffers.out[0]``, writes its bytes inside the member's stream;
        returns how many (blocks: call it on a worker thread).

        Raises:
          PeerFetchError: a shard could not be read.
          OSError: the rebuild was closed (it failed or was cancelled), or a write failed.
        """
        with self._idle:
            if self._closed:
                raise OSError(errno.ECANCELED, "the rebuild was closed")
            self._writing += 1
        try:
            sized = buffers.sized(size)
            for (reader, base), into in zip(readers.values(), sized.reads):
                if self._closed:  # cancelled or failed meanwhile: ``close`` waits for this thread, read no more
                    raise OSError(errno.ECANCELED, "the rebuild was closed")
                reader.read_into(self._ranges, base + offset, into)
            return self._rebuild(stripe, offset, dict(zip(readers, sized.reads)), sized.out[0])
        finally:
            with self._idle:
                self._writing -= 1
                self._idle.notify_all()

    def _rebuild(self, stripe: int, offset: int, got: dict[int, memoryview], piece: memoryview) -> int:
        layout = self._layout
        for i, body in got.items():
            if i >= layout.data:
                self._shards[(stripe, i, offset)] = (crc32c_extend(0, body), len(body))
        wanted = layout.contributors(stripe).index(self._position)
        self._code.rebuild_into(got, [wanted], {wanted: piece})
        start = layout.data_offset(self._position, stripe) + offset
        written = 0
        for rel, at, n in stream_pieces(self._files, start, len(piece)):  # past the stream's end: padding
            chunk = piece[self._starts[rel] + at - start :][:n]
            pwrite_all(self._fds[rel], chunk, at)
            self._pieces[(rel, at)] = (crc32c_extend(0, chunk), n)
            written += n
        return written

    def file_crcs(self) -> dict[str, int]:
        return _combined(self._pieces, {rel: () for rel in self._files})

    def shard_crcs(self) -> dict[tuple[int, int], int]:
        return _combined({((s, i), o): v for (s, i, o), v in self._shards.items()}, {})

    def close(self) -> None:
        """Closes the files and the connections once no chunk reads or writes (blocks: call it on a worker
        thread)."""
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: self._writing == 0)
        for fd in self._fds.values():
            os.close(fd)
        self._ranges.close()


def _combined(pieces: dict, keys: dict) -> dict:
    """key -> the CRC-32C of its pieces ((key, offset) -> (CRC, bytes)) joined in offset order; ``keys`` adds keys
    with no piece (an empty file: CRC 0)."""
    crcs = dict.fromkeys(keys, 0)
    for (key, _), (crc, n) in sorted(pieces.items(), key=lambda item: item[0]):
        crcs[key] = crc32c_combine(crcs.get(key, 0), crc, n)
    return crcs


def _create_files(dest_dir: str, files: Files) -> dict[str, int]:
    fds: dict[str, int] = {}
    try:
        for rel, (size, _) in files.items():
            safe_relpath(rel)
            path = os.path.join(dest_dir, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            fds[rel] = fd
            os.ftruncate(fd, size)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds
