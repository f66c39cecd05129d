"""How a parity group's steps are laid onto stripes (SCR's rotated layout, generalized to k parity shards).

A group has ``n`` members (ranks on distinct nodes) and ``k`` parity shards per stripe (``k = 1``: XOR). Each
member's step is one byte stream: its files in sorted path order, concatenated, padded with zeros to the
group's longest stream. There are ``n`` stripes. Stripe ``s`` keeps its ``k`` parity shards on the members at
positions ``s, s+1, ..., s+k-1`` (mod ``n``) and takes one data segment from each of the other ``n - k``
members, so every member holds ``k`` parity segments and contributes ``n - k`` data segments: its stream cut
into ``n - k`` segments of ``segment_bytes``. Any ``k`` members lost leave every stripe at least ``n - k`` of
its ``n`` shards, enough to rebuild the rest.

Memory: each member keeps its own step plus ``k`` segments of ``1/(n-k)`` of the longest stream, so the
group costs ``1 + k/(n-k)`` of the checkpoint, ``n/(n-1)`` for XOR (SCR's figure); full replicas cost
``1 + replicas``.
"""

import dataclasses
from collections.abc import Iterator, Mapping

from replicator.wire.messages import EncodeOrder, ParityRecipe

Files = Mapping[str, tuple[int, str]]  # path -> (size in bytes, CRC32C hex), as in a step's manifest


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One group's layout at one step.

    Attributes:
      members: the member ranks, in position order.
      parity: ``k``, the parity shards per stripe (1 <= k < len(members)).
      stream_bytes: each member's stream length, bytes, in position order.
    """

    members: tuple[int, ...]
    parity: int
    stream_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.parity < len(self.members):
            raise ValueError(f"a group of {len(self.members)} cannot have {self.parity} parity shards per stripe")
        if len(self.stream_bytes) != len(self.members):
            raise ValueError("one stream length per member")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def data(self) -> int:
        """Data segments per stripe: ``n - k``."""
        return self.size - self.parity

    @property
    def segment_bytes(self) -> int:
        """Bytes of each segment and each parity shard: the longest stream over ``n - k``, rounded up to 8
        (XOR runs on 64-bit words)."""
        longest = max(self.stream_bytes)
        per = -(-longest // self.data)
        return -(-per // 8) * 8

    @classmethod
    def of_group(cls, group: EncodeOrder | ParityRecipe) -> "GroupLayout":
        """The layout an encode order or a restore's recipe names."""
        return cls(tuple(m.rank for m in group.members), group.parity, tuple(group.stream_bytes))

    def data_offset(self, position: int, stripe: int) -> int:
        """Where ``position``'s data segment of ``stripe`` starts in its stream, bytes (``position`` must
        contribute to the stripe)."""
        return self.segment_of(position, stripe) * self.segment_bytes

    def holders(self, stripe: int) -> tuple[int, ...]:
        """Positions holding the stripe's parity shards, shard index order."""
        return tuple((stripe + j) % self.size for j in range(self.parity))

    def contributors(self, stripe: int) -> tuple[int, ...]:
        """Positions contributing the stripe's data segments, fragment index order."""
        return tuple((stripe + self.parity + i) % self.size for i in range(self.data))

    def segment_of(self, position: int, stripe: int) -> int:
        """Which of ``position``'s segments stripe ``stripe`` takes (``position`` must contribute to it)."""
        index = (position - stripe - self.parity) % self.size
        if index >= self.data:
            raise ValueError(f"position {position} holds parity of stripe {stripe}; it contributes no data to it")
        return index

    def held_by(self, position: int) -> list[tuple[int, int]]:
        """(stripe, shard index) of the parity shards ``position`` holds."""
        return [((position - j) % self.size, j) for j in range(self.parity)]

    def stripes_of(self, position: int) -> list[int]:
        """The stripes ``position`` contributes data to, in segment order."""
        return sorted(
            (s for s in range(self.size) if position in self.contributors(s)),
            key=lambda s: self.segment_of(position, s),
        )


def stream_bytes(files: Files) -> int:
    """A step's stream length: its files' sizes, summed (bytes)."""
    return sum(size for size, _ in files.values())


def stream_pieces(files: Files, start: int, length: int) -> Iterator[tuple[str, int, int]]:
    """The file pieces of stream bytes ``[start, start + length)``: (path, offset in the file, bytes), in stream
    order. Bytes past the stream's end (the group's padding) have no piece: they read as zeros."""
    position = 0
    end = start + length
    for path in sorted(files):
        size = files[path][0]
        lo, hi = max(start, position), min(end, position + size)
        if lo < hi:
            yield path, lo - position, hi - lo
        position += size
        if position >= end:
            return


def cluster_ram(size: int, parity: int) -> float:
    """Cluster RAM per unit of checkpoint under a group of ``size`` with ``parity`` shards per stripe (equal
    streams): the own copy plus ``parity / (size - parity)``."""
    return 1 + parity / (size - parity)
