"""Chunk buffers the encoder and the decoder reuse from chunk to chunk instead of allocating per chunk.

A multi-MiB buffer allocated per chunk comes back from glibc as fresh pages (it maps blocks that large and
unmaps them on free), and faulting them in costs several times the XOR itself (``tests/bench/parity_codec.py``).
"""

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ChunkBuffers:
    """One chunk's buffers: ``reads`` (one per shard read, in the order asked) and ``out`` (one per shard
    written), each ``chunk_bytes`` long; ``sized`` cuts them to a shorter last chunk."""

    reads: tuple[memoryview, ...]
    out: tuple[memoryview, ...]

    @classmethod
    def allocate(cls, reads: int, out: int, chunk_bytes: int) -> "ChunkBuffers":
        return cls(*(tuple(memoryview(bytearray(chunk_bytes)) for _ in range(n)) for n in (reads, out)))

    def sized(self, size: int) -> "ChunkBuffers":
        return ChunkBuffers(tuple(b[:size] for b in self.reads), tuple(b[:size] for b in self.out))


class FreeBuffers:
    """Sets of chunk buffers for chunks that run at once on worker threads (``run``), each set reused by the
    chunks after it; the most sets in use is the most chunks in flight.

    Args:
      reads, out, chunk_bytes: the shape of each set (``ChunkBuffers.allocate``).
    """

    def __init__(self, reads: int, out: int, chunk_bytes: int):
        self._shape = (reads, out, chunk_bytes)
        self._free: list[ChunkBuffers] = []  # touched on the event loop's thread only

    async def run(self, work: Callable[[ChunkBuffers], T]) -> T:
        """Runs ``work`` on a worker thread with a free set (a new one when none is free) and returns its result.

        The set is free again once the thread is done, not when the caller is cancelled: the thread runs on and
        still reads or writes it, so a cancelled chunk's set is never handed to the next chunk before then.
        """
        buffers = self._free.pop() if self._free else ChunkBuffers.allocate(*self._shape)
        future = asyncio.ensure_future(asyncio.to_thread(work, buffers))
        future.add_done_callback(functools.partial(self._done, buffers))
        return await asyncio.shield(future)

    def _done(self, buffers: ChunkBuffers, future: asyncio.Future) -> None:
        self._free.append(buffers)
        if not future.cancelled():
            future.exception()  # retrieved: after a cancel no one awaits it, and it may fail on purpose
