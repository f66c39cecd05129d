"""Chunk buffers the encoder and the decoder reuse from chunk to chunk instead of allocating per chunk.

A multi-MiB buffer allocated per chunk comes back from glibc as fresh pages (it maps blocks that large and
unmaps them on free), and faulting them in costs several times the XOR itself (``tests/bench/parity_codec.py``).
"""

import dataclasses


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
    """Free sets of chunk buffers, on the event loop's thread: ``take`` one (a new one when none is free) and
    ``give_back`` it only once nothing reads or writes it any more; a set never given back (its chunk failed
    while a read or a thread may still touch it) is left to the garbage collector.

    Args:
      reads, out, chunk_bytes: the shape of each set (``ChunkBuffers.allocate``).
    """

    def __init__(self, reads: int, out: int, chunk_bytes: int):
        self._shape = (reads, out, chunk_bytes)
        self._free: list[ChunkBuffers] = []

    def take(self) -> ChunkBuffers:
        return self._free.pop() if self._free else ChunkBuffers.allocate(*self._shape)

    def give_back(self, buffers: ChunkBuffers) -> None:
        self._free.append(buffers)
