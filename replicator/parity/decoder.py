"""Decoding: rebuilds a lost member's step from its group's survivors and parity shards (a ``Tier.DECODE``
source of the restore view), into an empty directory, checked against the owner's checksums.

Stripe by stripe, in the order of the member's segments (so its stream is written front to back): each chunk
reads ``n - k`` of the stripe's other shards, members' segments first (a read, no arithmetic), parity shards
for the rest, and rebuilds the member's segment. Every parity shard read is checked against the CRC-32C it
was built with, and every rebuilt file against the CRC-32C its owner reported: a decode hands out nothing
unverified.
"""

import asyncio
import os
from collections.abc import Callable

from replicator.local_tier.incoming import pwrite_all
from replicator.local_tier.step_manifest import CorruptCopy, UnusableCopy, crc32c_extend, safe_relpath
from replicator.parity.codec import codec
from replicator.parity.layout import Files, GroupLayout, stream_bytes, stream_pieces
from replicator.parity.reads import ShardStream, StepReads, open_members
from replicator.wire.messages import ParityRecipe

CHUNK_BYTES = 4 << 20


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
    layout = GroupLayout(tuple(m.rank for m in recipe.members), recipe.parity, recipe.stream_bytes)
    step = reads.step
    if rank not in layout.members:
        raise UnusableCopy(f"rank {rank} is not a member of group {list(layout.members)}")
    position = layout.members.index(rank)
    if stream_bytes(files) != layout.stream_bytes[position]:
        raise UnusableCopy(f"the parity of rank {rank} step {step} was built over another version of it")
    live = {p: m for p, m in enumerate(recipe.members) if m.url is not None and p != position}
    shards = {(s.stripe, s.index): s for s in recipe.shards}
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
    needed = {layout.contributors(s)[i] for s, chosen in plan.items() for i in chosen if i < layout.data}
    streams = await open_members(reads, {p: live[p] for p in needed}, dict(enumerate(layout.stream_bytes)))
    code = codec(layout.data, layout.parity)
    fds = _create_files(dest_dir, files)
    crcs = dict.fromkeys(files, 0)
    starts, at = {}, 0
    for rel in sorted(files):
        starts[rel], at = at, at + files[rel][0]
    length, own_bytes = layout.segment_bytes, layout.stream_bytes[position]
    try:
        for stripe, chosen in plan.items():
            segment = layout.segment_of(position, stripe)
            wanted = layout.contributors(stripe).index(position)
            readers = {
                i: (streams[layout.contributors(stripe)[i]], segment_base(layout, stripe, i))
                if i < layout.data
                else (
                    ShardStream(reads, layout.members[0], shards[(stripe, i - layout.data)]),
                    0,
                )
                for i in chosen
            }
            shard_crcs = dict.fromkeys((i for i in chosen if i >= layout.data), 0)
            for offset in range(0, length, chunk_bytes):
                start = (
                    segment * length + offset
                )  # past ``own_bytes``: the group's padding, read for the shards' checksums
                size = min(chunk_bytes, length - offset)
                bodies = await asyncio.gather(*(r.read(base + offset, size) for r, base in readers.values()))
                got = dict(zip(readers, bodies))
                for i in shard_crcs:
                    shard_crcs[i] = crc32c_extend(shard_crcs[i], got[i])
                piece = (await asyncio.to_thread(code.rebuild, got, [wanted]))[wanted]
                for rel, at, n in stream_pieces(files, start, size):
                    chunk = memoryview(piece)[starts[rel] + at - start :][:n]
                    pwrite_all(fds[rel], chunk, at)
                    crcs[rel] = crc32c_extend(crcs[rel], chunk)
                if on_range is not None and start < own_bytes:
                    on_range(min(size, own_bytes - start))
            for i, crc in shard_crcs.items():
                shard = shards[(stripe, i - layout.data)]
                if shard.crc32c is not None and f"{crc:08x}" != shard.crc32c:
                    raise CorruptCopy(
                        f"parity shard {i - layout.data} of stripe {stripe} on {shard.node} fails its checksum"
                    )
    finally:
        for fd in fds.values():
            os.close(fd)
    bad = sorted(rel for rel, (_, crc) in files.items() if f"{crcs[rel]:08x}" != crc)
    if bad:
        raise CorruptCopy(
            f"rank {rank} step {step} rebuilt from group {list(layout.members)} fails its checksums: "
            + ", ".join(bad[:5])
        )


def segment_base(layout: GroupLayout, stripe: int, index: int) -> int:
    """Where data shard ``index`` of ``stripe`` starts in its member's stream, bytes."""
    return layout.segment_of(layout.contributors(stripe)[index], stripe) * layout.segment_bytes


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
