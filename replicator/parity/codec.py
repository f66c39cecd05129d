"""The erasure codes: XOR for one parity shard (numpy), Reed-Solomon for more (pyeclib over ISA-L).

Both are systematic: the data shards are the members' segments as they are; only parity shards are stored.
Shard indices: ``0 .. data-1`` are the stripe's data segments (``GroupLayout.contributors`` order),
``data .. data+parity-1`` its parity shards.

Why these (2026-11-27, this 2-core machine, 4 MiB shards; ``tests/bench/parity_codec.py``): numpy's XOR runs
at or above memcpy; pyeclib 1.8.0 (BSD, its wheel bundles liberasurecode and ISA-L) encodes RS(8,2) at about
3 GB/s with ISA-L (Cauchy and Vandermonde level with buffers reused; Cauchy ahead in a first probe), several
times liberasurecode's own Vandermonde code. ``zfec`` is GPL; ``reedsolo``, ``galois`` and ``pyfinite`` are
pure Python.

pyeclib wants its fragments with their 80-byte headers. Those headers depend only on the fragment's index and
the encoded length (no data checksum is configured), so a decode rebuilds the data fragments' headers by
encoding zeros of the same length once per length.
"""

import abc
import ctypes
import ctypes.util
import functools
from collections.abc import Mapping, Sequence

import numpy as np

_RS_TYPE = "isa_l_rs_cauchy"

Segment = bytes | bytearray | memoryview


class Codec(abc.ABC):
    """An erasure code over ``data`` equal-length segments with ``parity`` parity shards.

    The ``*_into`` forms write into the caller's buffers (writable, each as long as a segment), which a data
    path allocates once and reuses chunk after chunk: a fresh multi-MiB buffer per call costs the page faults
    of new pages, several times the code itself (``tests/bench/parity_codec.py``). ``encode`` and ``rebuild``
    allocate their outputs.
    """

    data: int
    parity: int

    @abc.abstractmethod
    def encode_into(self, segments: Sequence[Segment], out: Sequence[memoryview]) -> None:
        """Writes the ``parity`` parity shards of ``data`` equal-length segments into ``out`` (in index order)."""

    @abc.abstractmethod
    def rebuild_into(self, shards: Mapping[int, Segment], wanted: Sequence[int], out: Mapping[int, memoryview]) -> None:
        """Writes the data segments ``wanted`` (indices below ``data``), rebuilt from at least ``data`` other
        shards by index, into ``out`` (index -> buffer).

        Raises:
          ValueError: fewer than ``data`` shards, or of unequal lengths.
        """

    def encode(self, segments: Sequence[Segment]) -> list[bytearray]:
        """The ``parity`` parity shards of ``data`` equal-length segments, each as long."""
        out = [bytearray(memoryview(segments[0]).nbytes) for _ in range(self.parity)]
        self.encode_into(segments, [memoryview(o) for o in out])
        return out

    def rebuild(self, shards: Mapping[int, Segment], wanted: Sequence[int]) -> dict[int, bytearray]:
        """The data segments ``wanted``, as ``rebuild_into`` (same errors)."""
        length = _check(self, shards, wanted)
        out = {i: bytearray(length) for i in wanted}
        self.rebuild_into(shards, wanted, {i: memoryview(o) for i, o in out.items()})
        return out


class Xor(Codec):
    """One parity shard: the XOR of the segments (numpy, 64-bit words; lengths are multiples of 8)."""

    parity = 1

    def __init__(self, data: int):
        self.data = data

    def encode_into(self, segments: Sequence[Segment], out: Sequence[memoryview]) -> None:
        words = [np.frombuffer(s, dtype=np.uint64) for s in segments]
        (parity,) = out
        into = np.frombuffer(parity, dtype=np.uint64)
        if len(words) == 1:
            np.copyto(into, words[0])
            return
        np.bitwise_xor(words[0], words[1], out=into)
        for w in words[2:]:
            np.bitwise_xor(into, w, out=into)

    def rebuild_into(self, shards: Mapping[int, Segment], wanted: Sequence[int], out: Mapping[int, memoryview]) -> None:
        _check(self, shards, wanted)
        if not wanted:
            return
        # One lost segment: the XOR of every other shard, parity included.
        (lost,) = wanted
        self.encode_into([shards[i] for i in range(self.data + 1) if i != lost], [out[lost]])


class ReedSolomon(Codec):
    """``parity`` parity shards by pyeclib's ISA-L Cauchy Reed-Solomon.

    pyeclib takes and returns ``bytes`` only (a ``bytearray`` fragment aborts the process in liberasurecode), so
    its inputs are copied once into a ``bytes`` and its fragments once into ``out``: the reuse stops at its API.
    """

    def __init__(self, data: int, parity: int):
        from pyeclib.ec_iface import ECDriver  # the agent imports it only for a job that asks for RS

        self.data, self.parity = data, parity
        self._driver = ECDriver(k=data, m=parity, ec_type=_RS_TYPE)
        _keep_heap_warm()

    def encode_into(self, segments: Sequence[Segment], out: Sequence[memoryview]) -> None:
        fragments = self._driver.encode(b"".join(segments))
        for into, f in zip(out, fragments[self.data :]):
            into[:] = memoryview(f)[_HEADER_BYTES:]

    def rebuild_into(self, shards: Mapping[int, Segment], wanted: Sequence[int], out: Mapping[int, memoryview]) -> None:
        length = _check(self, shards, wanted)
        if not wanted:
            return
        headers = self._headers(length)
        chosen = sorted(shards)[: self.data]
        rebuilt = self._driver.reconstruct([headers[i] + shards[i] for i in chosen], list(wanted))
        for i, f in zip(wanted, rebuilt):
            out[i][:] = memoryview(f)[_HEADER_BYTES:]

    @functools.lru_cache(maxsize=4)  # noqa: B019  # one driver per group layout; a few segment lengths each
    def _headers(self, length: int) -> list[bytes]:
        fragments = self._driver.encode(bytes(length * self.data))
        if any(len(f) != length + _HEADER_BYTES for f in fragments):
            raise ValueError(f"pyeclib pads {length}-byte segments; segments must be multiples of 8 bytes")
        return [bytes(f[:_HEADER_BYTES]) for f in fragments]


_HEADER_BYTES = 80  # liberasurecode's fragment header
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD_BYTES = 16 << 20  # above a chunk's fragment (4 MiB + 80): served from the heap
_TRIM_THRESHOLD_BYTES = 64 << 20  # free heap kept per malloc arena: a few chunks' fragments in flight


@functools.cache
def _keep_heap_warm() -> bool:
    """Has glibc serve pyeclib's per-call fragments from a heap it keeps; False where the libc is not glibc.

    pyeclib allocates every fragment it takes and returns (``bytes`` only), 4 MiB + 80 bytes per chunk and shard,
    and glibc maps blocks that large and unmaps them on free, so every call faults in fresh zeroed pages. With
    these thresholds they stay on the heap, warm: the decode of a 256 MiB rank of RS(4,2) took 0.71 s instead of
    1.42, and a node's shard build 1.0-2.1 s instead of 3.2-4.2 (2026-11-28, this 2-core machine, load 6-7;
    ``tests/bench/parity_restore.py``). Process-wide, once, when a job first asks for RS: it costs up to
    ``_TRIM_THRESHOLD_BYTES`` of freed heap kept per arena.
    """
    mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


def _check(codec: Codec, shards: Mapping[int, Segment], wanted: Sequence[int]) -> int:
    if len(shards) < codec.data:
        raise ValueError(f"{len(shards)} shards cannot rebuild a stripe of {codec.data} data segments")
    lengths = {memoryview(s).nbytes for s in shards.values()}
    if len(lengths) != 1:
        raise ValueError(f"shards of unequal lengths {sorted(lengths)}")
    if any(not 0 <= i < codec.data for i in wanted):
        raise ValueError(f"only data segments 0..{codec.data - 1} are rebuilt, not {list(wanted)}")
    return lengths.pop()


def codec(data: int, parity: int) -> Codec:
    """The code for ``data`` segments and ``parity`` shards per stripe: XOR for one, Reed-Solomon for more."""
    return Xor(data) if parity == 1 else ReedSolomon(data, parity)
