"""Encoding: carries out the coordinator's encode orders, building this node's parity shards of a group's step.

The node holds the parity shards of ``k`` stripes (``GroupLayout.held_by``); none of them takes data of its own,
so every byte is read from the other members' nodes over the peer tier, chunk by chunk, each chunk read and
encoded on a worker thread into the same buffers (``_Build``): memory stays at one chunk per segment of a stripe,
and the CPU cap (``--background-cpu``) is waited on after each chunk. A shard is
checksummed as it is written and installed (``ParityShards.install``) only whole; the next report tells the
coordinator. Off the training path: the members only serve reads of their committed steps.
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import shutil
import ssl
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
from replicator.peer_tier.client import PeerFetchError, RangeReads
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
      peer_ssl: TLS for ``https://`` peers (the peer CA), or None for the system's defaults.
    """

    def __init__(
        self,
        peer_token: Tokens,
        share: CpuShare | None,
        log_once: LogOnce,
        chunk_bytes: int = CHUNK_BYTES,
        peer_ssl: ssl.SSLContext | None = None,
    ):
        self._peer_token, self._peer_ssl = peer_token, peer_ssl
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
            reads = StepReads(session, self._peer_token.current, job.namespace, job.job, order.step, self._peer_ssl)
            streams = await open_members(
                reads, {p: order.members[p] for p in needed}, dict(enumerate(layout.stream_bytes))
            )
            code, shards, meta_dir = codec(layout.data, layout.parity), ParityShards(disk.path), JobMeta(disk.path)
            build = _Build(code, layout, streams, reads.ranges(), self._chunk_bytes)
            try:
                await self._build_missing(build, order, missing, shards, meta_dir)
            finally:
                await asyncio.to_thread(build.close)
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

    async def _build_missing(
        self,
        build: "_Build",
        order: EncodeOrder,
        missing: list[tuple[int, int]],
        shards: ParityShards,
        meta_dir: JobMeta,
    ) -> None:
        """Builds and installs each (stripe, index) shard of ``missing``, one after the other."""
        layout = build.layout
        for stripe, index in missing:
            incoming = meta_dir.new_incoming_dir()
            try:
                path = os.path.join(incoming, "shard")
                crc = await self._build(build, stripe, index, path)
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

    async def _build(self, build: "_Build", stripe: int, index: int, path: str) -> int:
        """Writes parity shard ``index`` of ``stripe`` (``segment_bytes`` long) to a new file at ``path``; returns
        its CRC-32C, computed as it was written."""
        crc, length = 0, build.layout.segment_bytes
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for offset in range(0, length, build.chunk_bytes):
                size = min(build.chunk_bytes, length - offset)
                encoding = asyncio.ensure_future(asyncio.to_thread(build.chunk, stripe, index, fd, offset, size, crc))
                try:
                    crc = await asyncio.shield(encoding)
                except asyncio.CancelledError:  # its thread runs on: ``fd`` and the buffers are free after it
                    await asyncio.wait([encoding])
                    raise
                if self._share is not None:
                    await self._share.wait()
        finally:
            os.close(fd)
        return crc


def _basis(order: EncodeOrder) -> str:
    return redundancy.basis(tuple(m.digest or "" for m in order.members))


@dataclasses.dataclass
class _Build:
    """One encode's reads and code: chunk by chunk, one chunk at a time, into the same buffers."""

    code: Codec
    layout: GroupLayout
    streams: Mapping[int, MemberStream]
    ranges: RangeReads
    chunk_bytes: int

    def __post_init__(self) -> None:
        self.buffers = ChunkBuffers.allocate(self.layout.data, self.layout.parity, self.chunk_bytes)
        # The segments of a chunk are read at once, one thread each, from their members' nodes.
        self._reads = concurrent.futures.ThreadPoolExecutor(self.layout.data, thread_name_prefix="parity-read")

    def chunk(self, stripe: int, index: int, fd: int, offset: int, size: int, crc: int) -> int:
        """Reads ``size`` bytes at ``offset`` of each segment of ``stripe``, encodes them, writes parity shard
        ``index``'s piece at ``offset`` of ``fd``; returns ``crc`` extended by it (on a worker thread: the socket
        reads, numpy, ISA-L and the CRC release the GIL).

        Raises:
          PeerFetchError: a segment could not be read.
          OSError: the write failed.
        """
        sized, layout = self.buffers.sized(size), self.layout
        reads = [
            self._reads.submit(self.streams[p].read_into, self.ranges, layout.data_offset(p, stripe) + offset, into)
            for p, into in zip(layout.contributors(stripe), sized.reads)
        ]
        concurrent.futures.wait(reads)  # every read done, a failed one's siblings too: none writes the buffers after
        for read in reads:
            read.result()
        self.code.encode_into(sized.reads, sized.out)
        piece = sized.out[index]
        pwrite_all(fd, piece, offset)
        return crc32c_extend(crc, piece)

    def close(self) -> None:
        """Stops the read threads and closes the connections (blocks: call it on a worker thread)."""
        self._reads.shutdown()
        self.ranges.close()
