"""The rank directories of a step, in each of its layouts, and their ``.metadata`` merged into DCP's global one.

A step directory has one of three layouts (docs/pytorch.md, "The files"):

- a rank directory: ``.metadata`` and ``__0_<k>.distcp``, one local rank's self-contained (``no_dist``) checkpoint;
- a node's step, as a node commits it: ``rank-<r>-of-<W>/``, one per local rank;
- a multi-node step, as an elastic restore stages it and ``mtc export`` assembles it:
  ``node-<n>-of-<N>/rank-<r>-of-<W>/``, each ``node-<n>-of-<N>/`` a copy of node ``n``'s step (any subset of the
  ``N`` nodes).

:func:`merge_metadata` makes the DCP ``Metadata`` of the whole: each tensor's chunks from every rank (a chunk that
several ranks store alike, a data-parallel replica's, once: the first rank's), the first rank's non-tensor items,
and ``storage_data`` whose relative paths lead from the step directory into the rank directories.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from mtc_torch.protocol import METADATA_FILE
from mtc_torch.storage import load_metadata

RANK_DIR_RE = re.compile(r"^rank-([0-9]{1,6})-of-([0-9]{1,6})$")
NODE_DIR_RE = re.compile(r"^node-([0-9]{1,6})-of-([0-9]{1,6})$")


@dataclasses.dataclass(frozen=True, order=True)
class RankDir:
    """One rank's directory inside a step: ``node`` of ``nodes`` (None outside a multi-node step), local ``rank`` of ``ranks``
    (None for a bare rank directory), and its path relative to the step directory (``""``: the step itself)."""

    node: int | None
    nodes: int | None
    rank: int | None
    ranks: int | None
    relative: str


def rank_dirs(step_dir: str | os.PathLike[str]) -> list[RankDir]:
    """The rank directories of ``step_dir``, in (node, local rank) order.

    Raises:
        ValueError: no layout above; ``rank-*`` beside ``node-*``; names that disagree on ``W`` or ``N``; a rank
            out of its range.
    """
    path = Path(step_dir)
    if (path / METADATA_FILE).is_file():
        return [RankDir(None, None, None, None, "")]
    nodes = _subdirs(path, NODE_DIR_RE)
    ranks = _subdirs(path, RANK_DIR_RE)
    if nodes and ranks:
        raise ValueError(f"{path} mixes node-*-of-N and rank-*-of-W directories: not a step")
    if ranks:
        found = [RankDir(None, None, r, w, name) for name, r, w in ranks]
    elif nodes:
        found = [
            RankDir(n, big_n, r, w, f"{node_name}/{name}")
            for node_name, n, big_n in nodes
            for name, r, w in _subdirs(path / node_name, RANK_DIR_RE)
        ]
    else:
        raise ValueError(f"{path} holds no {METADATA_FILE}, rank-<r>-of-<W>/ or node-<n>-of-<N>/: not a step")
    for what, values in (("local ranks", {d.ranks for d in found}), ("nodes", {d.nodes for d in found})):
        if len(values) > 1:
            raise ValueError(f"{path}: its directories disagree on the number of {what}: {sorted(values)}")  # type: ignore[type-var]
    if not found:
        raise ValueError(f"{path}: its node directories hold no rank-<r>-of-<W>/")
    return sorted(found)


def _subdirs(path: Path, pattern: re.Pattern[str]) -> list[tuple[str, int, int]]:
    """(name, index, count) of the directories (never a symlink) in ``path`` named by ``pattern``."""
    found = []
    with os.scandir(path) as entries:
        for entry in entries:
            match = pattern.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                index, count = int(match[1]), int(match[2])
                if not 0 <= index < count:
                    raise ValueError(f"{path / entry.name}: {index} is not in range({count})")
                found.append((entry.name, index, count))
    return sorted(found)


def merge_metadata(step_dir: str | os.PathLike[str], dirs: list[RankDir]) -> Metadata:
    """DCP's ``Metadata`` of the rank directories ``dirs`` of ``step_dir``, merged in the order given.

    Returns:
        ``state_dict_metadata``: every key; a tensor's chunks from every rank, each (offsets, sizes) once, from the
        first rank storing it; a non-tensor item from the first rank storing it. ``storage_data``: each stored
        item's ``MetadataIndex`` -> ``_StorageInfo`` whose ``relative_path`` is ``<rank dir>/<file>``.

    Raises:
        ValueError: a rank's ``.metadata`` is missing or refused (:func:`mtc_torch.storage.load_metadata`), names a
            data file outside its directory, or disagrees with another's on a key's type, dtype or size.
    """
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={}, storage_meta=StorageMeta())
    for rank_dir in dirs:
        where = Path(step_dir) / rank_dir.relative
        try:
            metadata = load_metadata(where / METADATA_FILE)
        except FileNotFoundError:
            raise ValueError(f"{where} holds no {METADATA_FILE}: an incomplete rank directory") from None
        merged.version = merged.version or metadata.version
        taken = {fqn: _merge_item(merged, fqn, value, where) for fqn, value in metadata.state_dict_metadata.items()}
        for index, info in (metadata.storage_data or {}).items():
            if index in merged.storage_data or not _taken(taken, index):
                continue
            if "/" in info.relative_path or info.relative_path.startswith("."):
                raise ValueError(f"{where}/{METADATA_FILE} names {info.relative_path!r}, outside its directory")
            relative = f"{rank_dir.relative}/{info.relative_path}" if rank_dir.relative else info.relative_path
            merged.storage_data[index] = dataclasses.replace(info, relative_path=relative)
        for key, value in (metadata.planner_data or {}).items():
            merged.planner_data.setdefault(key, value)
    return merged


def _merge_item(merged: Metadata, fqn: str, value: object, where: Path) -> set[tuple[int, ...]] | bool:
    """Adds ``value`` (one rank's metadata of ``fqn``) to ``merged``; returns what of it was taken: the offsets
    of its new chunks (a tensor), or whether it was taken (a non-tensor item: only from the first rank)."""
    have = merged.state_dict_metadata.get(fqn)
    if not isinstance(value, TensorStorageMetadata):
        if isinstance(have, TensorStorageMetadata):
            raise ValueError(f"{where}: {fqn!r} is not a tensor here but is one in another rank's directory")
        merged.state_dict_metadata.setdefault(fqn, value)  # type: ignore[arg-type]  # BytesStorageMetadata
        return have is None
    if have is None:
        have = merged.state_dict_metadata[fqn] = TensorStorageMetadata(value.properties, value.size, [])
    elif not isinstance(have, TensorStorageMetadata) or (have.properties.dtype, have.size) != (
        value.properties.dtype,
        value.size,
    ):
        raise ValueError(f"{where}: {fqn!r} is stored here as another type, dtype or size than in another rank's")
    stored = {tuple(chunk.offsets): tuple(chunk.sizes) for chunk in have.chunks}
    new = set()
    for chunk in value.chunks:
        offsets = tuple(chunk.offsets)
        if offsets in stored:
            if stored[offsets] != tuple(chunk.sizes):
                raise ValueError(f"{where}: {fqn!r} has a chunk at {list(offsets)} of another size than another rank's")
            continue
        have.chunks.append(chunk)
        stored[offsets] = tuple(chunk.sizes)
        new.add(offsets)
    return new


def _taken(taken: dict[str, set[tuple[int, ...]] | bool], index: MetadataIndex) -> bool:
    """Whether the item at ``index`` came from the rank being merged."""
    what = taken.get(index.fqn, False)
    if isinstance(what, bool):
        return what
    return tuple(index.offset or ()) in what
