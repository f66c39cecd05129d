"""Encoding: carries out the coordinator's encode orders, building this node's parity shards of a group's step.

The node holds the parity shards of ``k`` stripes (``GroupLayout.held_by``); none of them takes data of its own,
so every byte is read from the other members' nodes over the peer tier, chunk by chunk: memory stays at one
chunk per segment of a stripe, and the CPU cap (``--background-cpu``) is waited on after each chunk. A shard is
checksummed as it is written and installed (``ParityShards.install``) only whole; the next report tells the
coordinator. Off the training path: the members only serve reads of their committed steps.
"""

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Mapping

import aiohttp
from prometheus_client import Counter

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier.incoming import pwrite_all
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.log_once import LogOnce
from replicator.local_tier.parity_shards import ParityShards, ShardMeta
from replicator.local_tier.step_manifest import crc32c_extend
from replicator.pacing.cpu_share import CpuShare
from replicator.parity.buffers import ChunkBuffers
from replicator.parity.codec import Codec, codec
from replicator.parity.layout import GroupLayout
from replicator.parity.reads import MemberStream, StepReads, open_members
from replicator.peer_tier.client import PeerFetchError
from replicator.wire import redundancy
from replicator.wire.bearer import Tokens
from replicator.wire.messages import EncodeOrder, JobRef

log = logging.getLogger(__name__)

ENCODED = Counter("mtc_parity_shards_built_total", "Parity shards built (xor/rs redundancy)", ["result"])
ENCODED_BYTES = Counter("mtc_parity_bytes_total", "Bytes of parity shards built")
for _label in ("ok", "failed"):
    ENCODED.labels(_label)

CHUNK_BYTES = 4 << 20  # per segment per step of the loop: a few MiB keeps HTTP cheap and memory small


class Encoder:
    """The node's encodes, one task per order (job, step, group) at a time.

    Args:
      peer_token: bearer tokens of the peer tier (the current one is sent).
      share: the CPU cap while jobs train, or None.
      log_once: the agent's throttled error log.
      chunk_bytes: bytes of each segment read per step of the loop.
    """

    def __init__(self, peer_token: Tokens, share: CpuShare | None, log_once: LogOnce, chunk_bytes: int = CHUNK_BYTES):
        self._peer_token = peer_token
        self._share = share
        self._log_once = log_once
        self._chunk_bytes = chunk_bytes
        self._running: dict[tuple[JobRef, int, int], asyncio.Task] = {}

    def tasks(self) -> list[asyncio.Task]:
        return list(self._running.values())

    def start(self, session: aiohttp.ClientSession, disks: Mapping[JobRef, Ramdisk], order: EncodeOrder) -> None:
        """Starts the order's encode in the background unless it runs or its shards are held."""
        job = JobRef(order.namespace, order.job)
        disk = disks.get(job)
        self._running = {k: t for k, t in self._running.items() if not t.done()}
        key = (job, order.step, order.members[0].rank)
        if disk is None or key in self._running or not self._missing(disk, order):
            return
        self._running[key] = asyncio.create_task(self._encode(session, job, disk, order))

    def _missing(self, disk: Ramdisk, order: EncodeOrder) -> list[tuple[int, int]]:
        """The (stripe, index) of the order's shards this node does not hold as ordered (same group, same basis)."""
        layout, shards, built_over = GroupLayout.of_group(order), ParityShards(disk.path), _basis(order)
        missing = []
        for stripe, index in layout.held_by(order.position):
            meta = shards.meta(order.step, layout.members[0], stripe)
            if meta is None or (meta.members, meta.parity, meta.index, meta.basis) != (
                layout.members,
                layout.parity,
                index,
                built_over,
            ):
                missing.append((stripe, index))
        return missing

    async def _encode(self, session: aiohttp.ClientSession, job: JobRef, disk: Ramdisk, order: EncodeOrder) -> None:
        layout, started = GroupLayout.of_group(order), time.monotonic()
        try:
            missing = self._missing(disk, order)
            needed = {p for stripe, _ in missing for p in layout.contributors(stripe)}
            lost = [order.members[p].rank for p in needed if order.members[p].url is None]
            if lost:
                raise PeerFetchError(f"no live node holds ranks {sorted(lost)}")
            reads = StepReads(session, self._peer_token.current, job.namespace, job.job, order.step)
            streams = await open_members(
                reads, {p: order.members[p] for p in needed}, dict(enumerate(layout.stream_bytes))
            )
            code, shards, meta_dir = codec(layout.data, layout.parity), ParityShards(disk.path), JobMeta(disk.path)
            buffers = ChunkBuffers.allocate(layout.data, layout.parity, self._chunk_bytes)  # reused chunk by chunk
            for stripe, index in missing:
                incoming = meta_dir.new_incoming_dir()
                try:
                    path = os.path.join(incoming, "shard")
                    crc = await self._build(code, layout, streams, (stripe, index), path, buffers)
                    shard = ShardMeta(
                        step=order.step,
                        members=layout.members,
                        parity=layout.parity,
                        stream_bytes=layout.stream_bytes,
                        stripe=stripe,
                        index=index,
                        bytes=layout.segment_bytes,
                        crc32c=f"{crc:08x}",
                        basis=_basis(order),
                    )
                    await asyncio.to_thread(shards.install, path, shard)
                    ENCODED.labels("ok").inc()
                    ENCODED_BYTES.inc(shard.bytes)
                finally:
                    await asyncio.to_thread(shutil.rmtree, incoming, True)
            log.info(
                "%s: built %d parity shard(s) of step %d, group %s, in %.2f s",
                job,
                len(missing),
                order.step,
                list(layout.members),
                time.monotonic() - started,
            )
        except (TimeoutError, PeerFetchError, OSError, aiohttp.ClientError, ValueError) as err:
            ENCODED.labels("failed").inc()
            self._log_once(
                f"encode-{order.step}-{layout.members[0]}",
                f"building parity of step {order.step} for group {list(layout.members)} failed: {err}",
            )

    async def _build(
        self,
        code: Codec,
        layout: GroupLayout,
        streams: Mapping[int, MemberStream],
        shard: tuple[int, int],
        path: str,
        buffers: ChunkBuffers,
    ) -> int:
        """Writes parity shard (stripe, index) ``shard`` (``layout.segment_bytes`` long) to a new file at ``path``;
        returns its CRC-32C, computed as it was written. Each chunk reads and encodes into ``buffers``, free again
        once the chunk's thread is done: every step of the loop waits for it, a cancelled one too."""
        (stripe, index), crc, length = shard, 0, layout.segment_bytes
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for offset in range(0, length, self._chunk_bytes):
                sized = buffers.sized(min(self._chunk_bytes, length - offset))
                await asyncio.gather(
                    *(
                        streams[p].read_into(layout.data_offset(p, stripe) + offset, into)
                        for p, into in zip(layout.contributors(stripe), sized.reads)
                    )
                )
                encoding = asyncio.ensure_future(asyncio.to_thread(_encode_into, code, sized, index, fd, offset, crc))
                try:
                    crc = await asyncio.shield(encoding)
                except asyncio.CancelledError:  # its thread writes on: ``fd`` closes after it (a number is reused)
                    await asyncio.wait([encoding])
                    raise
                if self._share is not None:
                    await self._share.wait()
        finally:
            os.close(fd)
        return crc


def _basis(order: EncodeOrder) -> str:
    return redundancy.basis(tuple(m.digest or "" for m in order.members))


def _encode_into(code: Codec, buffers: ChunkBuffers, index: int, fd: int, offset: int, crc: int) -> int:
    """Encodes one chunk of a stripe (``buffers.reads``) into ``buffers.out``, writes parity shard ``index``'s
    piece at ``offset``; returns the CRC-32C extended by it (on a worker thread: numpy, ISA-L and the CRC release
    the GIL)."""
    code.encode_into(buffers.reads, buffers.out)
    piece = buffers.out[index]
    pwrite_all(fd, piece, offset)
    return crc32c_extend(crc, piece)
