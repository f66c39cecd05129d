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

import functools
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

_RS_TYPE = "isa_l_rs_cauchy"


class Codec(Protocol):
    """An erasure code over ``data`` equal-length segments with ``parity`` parity shards."""

    data: int
    parity: int

    def encode(self, segments: Sequence[bytes | memoryview]) -> list[bytes]:
        """The ``parity`` parity shards of ``data`` equal-length segments (bytes, each as long)."""
        ...

    def rebuild(self, shards: Mapping[int, bytes | memoryview], wanted: Sequence[int]) -> dict[int, bytes]:
        """The data segments ``wanted`` (indices below ``data``), from at least ``data`` other shards by index.

        Raises:
          ValueError: fewer than ``data`` shards, or of unequal lengths.
        """
        ...


class Xor:
    """One parity shard: the XOR of the segments (numpy, 64-bit words; lengths are multiples of 8)."""

    parity = 1

    def __init__(self, data: int):
        self.data = data

    def encode(self, segments: Sequence[bytes | memoryview]) -> list[bytes]:
        words = [np.frombuffer(s, dtype=np.uint64) for s in segments]
        out = words[0].copy()
        for w in words[1:]:
            np.bitwise_xor(out, w, out=out)
        return [out.tobytes()]

    def rebuild(self, shards: Mapping[int, bytes | memoryview], wanted: Sequence[int]) -> dict[int, bytes]:
        _check(self, shards, wanted)
        if not wanted:
            return {}
        # One lost segment: the XOR of every other shard, parity included.
        (lost,) = wanted
        return {lost: self.encode([shards[i] for i in range(self.data + 1) if i != lost])[0]}


class ReedSolomon:
    """``parity`` parity shards by pyeclib's ISA-L Cauchy Reed-Solomon."""

    def __init__(self, data: int, parity: int):
        from pyeclib.ec_iface import ECDriver  # the agent imports it only for a job that asks for RS

        self.data, self.parity = data, parity
        self._driver = ECDriver(k=data, m=parity, ec_type=_RS_TYPE)

    def encode(self, segments: Sequence[bytes | memoryview]) -> list[bytes]:
        fragments = self._driver.encode(b"".join(segments))
        return [bytes(memoryview(f)[_HEADER_BYTES:]) for f in fragments[self.data :]]

    def rebuild(self, shards: Mapping[int, bytes | memoryview], wanted: Sequence[int]) -> dict[int, bytes]:
        length = _check(self, shards, wanted)
        if not wanted:
            return {}
        headers = self._headers(length)
        chosen = sorted(shards)[: self.data]
        rebuilt = self._driver.reconstruct([headers[i] + bytes(shards[i]) for i in chosen], list(wanted))
        return {i: bytes(memoryview(f)[_HEADER_BYTES:]) for i, f in zip(wanted, rebuilt)}

    @functools.lru_cache(maxsize=4)  # noqa: B019  # one driver per group layout; a few segment lengths each
    def _headers(self, length: int) -> list[bytes]:
        fragments = self._driver.encode(bytes(length * self.data))
        if any(len(f) != length + _HEADER_BYTES for f in fragments):
            raise ValueError(f"pyeclib pads {length}-byte segments; segments must be multiples of 8 bytes")
        return [bytes(f[:_HEADER_BYTES]) for f in fragments]


_HEADER_BYTES = 80  # liberasurecode's fragment header


def _check(codec: Codec, shards: Mapping[int, bytes | memoryview], wanted: Sequence[int]) -> int:
    if len(shards) < codec.data:
        raise ValueError(f"{len(shards)} shards cannot rebuild a stripe of {codec.data} data segments")
    lengths = {len(s) for s in shards.values()}
    if len(lengths) != 1:
        raise ValueError(f"shards of unequal lengths {sorted(lengths)}")
    if any(not 0 <= i < codec.data for i in wanted):
        raise ValueError(f"only data segments 0..{codec.data - 1} are rebuilt, not {list(wanted)}")
    return lengths.pop()


def codec(data: int, parity: int) -> Codec:
    """The code for ``data`` segments and ``parity`` shards per stripe: XOR for one, Reed-Solomon for more."""
    return Xor(data) if parity == 1 else ReedSolomon(data, parity)
