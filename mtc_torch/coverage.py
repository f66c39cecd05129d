"""Whether a load reads every element it asks for: the check that a restore is never silently partial.

Each rank's ``.metadata`` (``<step>/rank-<r>-of-<W>/``) holds only the chunks that rank saved. DCP plans a read only
where a stored chunk and a wanted chunk overlap, and checks that the plans cover the destinations only when there is
more than one plan; a ``no_dist`` load makes one. So a load into another mesh (saved ``Shard(0)``, loaded
``Replicate()``; FSDP to HSDP; another tensor-parallel degree) would return with part of each destination never
written. :func:`check_coverage` compares, before anything is read, each destination's wanted chunks with the chunks
the checkpoint stores, and raises :class:`PartialRestoreError` for what no stored chunk covers. A step read through
:class:`mtc_torch.reader.StepReader` merges every present rank's chunks: the check then refuses a load that the
present ranks do not cover (a node's copy missing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

_NAMED = 5  # the keys one error names in full; the rest are counted


@dataclasses.dataclass(frozen=True)
class Region:
    """A box of a tensor's global index space: ``offsets`` and ``sizes`` per dimension, in elements."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, chunk: ChunkStorageMetadata) -> Region:
        return cls(tuple(chunk.offsets), tuple(chunk.sizes))

    @property
    def elements(self) -> int:
        return math.prod(self.sizes)

    def overlap(self, other: Region) -> int:
        """The number of elements in both boxes."""
        return math.prod(
            max(0, min(a + m, b + n) - max(a, b))
            for a, m, b, n in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )

    def __str__(self) -> str:
        return f"offsets {list(self.offsets)} sizes {list(self.sizes)}"


@dataclasses.dataclass(frozen=True)
class Uncovered:
    """One wanted chunk of key ``key`` that the stored chunks cover only in part (``read`` of its elements)."""

    key: str
    wanted: Region
    stored: tuple[Region, ...]
    read: int

    def __str__(self) -> str:
        stored = ", ".join(f"[{region}]" for region in self.stored) or "none"
        return (
            f"{self.key!r} wants [{self.wanted}] but the checkpoint stores {stored}: "
            f"{self.wanted.elements - self.read} of its {self.wanted.elements} elements would not be read"
        )


class PartialRestoreError(ValueError):
    """A load would leave part of its destinations unread: the checkpoint does not store every wanted element.

    Attributes:
        where: the checkpoint directory.
        uncovered: each wanted chunk not wholly stored, with its key, wanted region and stored regions.
    """

    def __init__(self, where: str, uncovered: Sequence[Uncovered]) -> None:
        self.where = where
        self.uncovered = tuple(uncovered)
        named = "; ".join(str(u) for u in self.uncovered[:_NAMED])
        more = len(self.uncovered) - _NAMED
        super().__init__(
            f"{where}: refusing a partial restore, nothing was loaded: {named}"
            + (f"; and {more} more" if more > 0 else "")
            + ". The ranks read here do not store every element this state's sharding (mesh, placements or world "
            "size) asks for: read the whole step (every node's ranks) with mtc_torch.StepReader."
        )


def check_coverage(state_dict: Mapping[str, Any], stored: Mapping[str, TensorStorageMetadata], where: str) -> None:
    """Raises unless every element of every tensor in ``state_dict`` that this process loads is stored.

    Args:
        state_dict: the planner's flattened state dict (DCP keys to destinations: tensors and DTensors; other values
            are not checked here, as DCP's planner refuses a key the checkpoint lacks).
        stored: the checkpoint's tensors by key (from its metadata: one rank's chunks, or a step's merged ones).
        where: what to name the checkpoint by in the error.

    Raises:
        PartialRestoreError: some wanted elements are stored in no chunk.
        ValueError: two stored chunks of one tensor overlap (a malformed checkpoint).
    """
    check_regions({key: _wanted(value) for key, value in state_dict.items() if key in stored}, stored, where)


def check_regions(
    wanted: Mapping[str, Iterable[Region]], stored: Mapping[str, TensorStorageMetadata], where: str
) -> None:
    """:func:`check_coverage` for wanted regions given by key (each key one of ``stored``'s)."""
    uncovered = []
    for key, regions in wanted.items():
        chunks = tuple(Region.of(chunk) for chunk in stored[key].chunks)
        _refuse_overlaps(key, chunks, where)
        for region in regions:
            read = sum(region.overlap(chunk) for chunk in chunks)  # exact: the stored chunks are disjoint
            if read < region.elements:
                uncovered.append(Uncovered(key, region, chunks, read))
    if uncovered:
        raise PartialRestoreError(where, uncovered)


def _wanted(value: Any) -> Iterator[Region]:
    """The chunks of the global tensor this process loads into ``value``, as DCP's planner asks for them."""
    if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
        return  # not on this rank's mesh: DCP loads nothing into it here
    if hasattr(value, "__create_chunk_list__"):  # DTensor and other tensors DCP shards (its _Checkpointable protocol)
        yield from (Region.of(chunk) for chunk in value.__create_chunk_list__())
    elif hasattr(value, "local_shards"):  # a ShardedTensor (FSDP1's sharded state dict): its shards on this rank
        for shard in value.local_shards():
            yield Region(tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
    elif isinstance(value, torch.Tensor):
        yield Region((0,) * value.dim(), tuple(value.shape))


def _refuse_overlaps(key: str, chunks: tuple[Region, ...], where: str) -> None:
    """Compares only the chunks whose spans along the first dimension meet (a step merged from many ranks stores
    a tensor in as many chunks: all pairs would take quadratic time)."""
    order = sorted(chunks, key=lambda c: c.offsets[:1])
    for i, chunk in enumerate(order):
        end = chunk.offsets[0] + chunk.sizes[0] if chunk.offsets else None
        for other in order[i + 1 :]:
            if end is not None and other.offsets[0] >= end:
                break
            if chunk.overlap(other):
                raise ValueError(f"{where}: {key!r} is stored in overlapping chunks [{chunk}] and [{other}]")
