"""A step exported as a checkpoint that stock torch reads: DCP's ``FileSystemWriter`` format, or Hugging Face
safetensors as DCP's ``HuggingFaceStorageWriter`` writes them.

The step is read through :class:`mtc_torch.reader.StepReader` (any layout; every node's ranks must be present) and
written by torch's own writers, so the export needs no ``mtc_torch`` to load:

- ``dcp``: each stored chunk (a data-parallel replica's once) as its own item, ``torch.save`` bytes as
  ``FileSystemWriter`` writes them, and a global ``.metadata``: ``dcp.load(state_dict, checkpoint_id=DIR)`` loads it
  at any world size and mesh. Memory: one chunk at a time per thread.
- ``safetensors``: each tensor whole (its chunks joined), in files of at most :data:`SAFETENSORS_FILE_BYTES`, with
  ``model.safetensors.index.json``; non-tensor items (numbers, dataloader state) have no place there and are left
  out. Memory: one file's tensors.

The export is written into a temporary sibling of the destination and renamed to it once complete. Whether the
step's bytes are the ones saved is checked before (``mtc export`` verifies the step's checksums).
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from mtc_torch.coverage import Region, check_regions
from mtc_torch.reader import StepReader, _Files

FORMATS = ("dcp", "safetensors")
SAFETENSORS_FILE_BYTES = 5 * 10**9
"""The most tensor bytes one safetensors file holds (Hugging Face's default ``max_shard_size``, 5 GB)."""


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote: ``items`` (chunks or tensors, and non-tensor items), ``bytes`` read from the step,
    and the non-tensor keys ``left_out`` (safetensors only)."""

    items: int
    bytes: int
    left_out: tuple[str, ...]


def export_step(
    step_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    fmt: str = "dcp",
    threads: int = 4,
    progress: Callable[[int], None] | None = None,
) -> Exported:
    """Writes the step at ``step_dir`` to ``out_dir`` (which must not exist) in format ``fmt``.

    Args:
        step_dir: a step in any layout :class:`mtc_torch.reader.StepReader` reads, holding every node's ranks.
        out_dir: the export's directory; its parent must exist.
        fmt: ``dcp`` or ``safetensors``.
        threads: files written at once.
        progress: called with the bytes of each item read from the step (from the writer's threads).

    Raises:
        PartialRestoreError: the step lacks some tensor's elements (a node's ranks are missing).
        FileExistsError: ``out_dir`` exists.
        ValueError: an unknown format, or the step is refused (:class:`mtc_torch.reader.StepReader`).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {', '.join(FORMATS)}")
    out = Path(out_dir)
    if os.path.lexists(out):
        raise FileExistsError(f"{out} exists: an export goes to a new directory")
    reader = StepReader(step_dir, threads=threads)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    check_regions({k: [Region((0,) * len(v.size), tuple(v.size))] for k, v in tensors.items()}, tensors, str(step_dir))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        with reader.open_files() as files:
            source = _Source(reader, files, progress)
            if fmt == "dcp":
                items = _chunk_items(metadata)
                writer: StorageWriter = FileSystemWriter(tmp, thread_count=threads)
            else:
                items = _tensor_items(tensors)
                writer = HuggingFaceStorageWriter(str(tmp), _files_of(tensors), thread_count=threads)
            _write(writer, items, source, metadata)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    left_out = tuple(sorted(set(metadata.state_dict_metadata) - set(tensors))) if fmt == "safetensors" else ()
    return Exported(len(items), source.bytes, left_out)


class _Source:
    """The ``resolve_data`` half of a ``SavePlanner``, all torch's writers call: each item read from the step."""

    def __init__(self, reader: StepReader, files: _Files, progress: Callable[[int], None] | None) -> None:
        self._reader, self._files, self._progress = reader, files, progress
        self._lock = threading.Lock()
        self.bytes = 0

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        if item.type != WriteItemType.TENSOR:  # a stored chunk, or a non-tensor item: as stored
            return self._read(item.index)
        assert item.tensor_data is not None
        tensors = self._reader.storage_data.keys()
        whole = torch.empty(item.tensor_data.size, dtype=item.tensor_data.properties.dtype)
        for index in (i for i in tensors if i.fqn == item.index.fqn):
            chunk = cast(torch.Tensor, self._read(index))
            target = whole
            for dim, (start, length) in enumerate(zip(index.offset or (), chunk.shape, strict=True)):
                target = target.narrow(dim, start, length)
            target.copy_(chunk)
        return whole

    def _read(self, index: MetadataIndex) -> torch.Tensor | io.BytesIO:
        data = self._reader.read_item(self._files, index)
        length = self._reader.storage_data[index].length
        with self._lock:
            self.bytes += length
        if self._progress is not None:
            self._progress(length)
        return data


def _chunk_items(metadata: Metadata) -> list[WriteItem]:
    """One item per stored chunk and per non-tensor item, as DCP's planner makes them for a sharded save."""
    items = []
    for index in metadata.storage_data:
        value = metadata.state_dict_metadata[index.fqn]
        if not isinstance(value, TensorStorageMetadata):
            items.append(WriteItem(index=MetadataIndex(index.fqn), type=WriteItemType.BYTE_IO))
            continue
        chunk = next(c for c in value.chunks if tuple(c.offsets) == tuple(index.offset or ()))
        data = TensorWriteData(chunk=chunk, properties=value.properties, size=value.size)
        items.append(
            WriteItem(index=MetadataIndex(index.fqn, index.offset), type=WriteItemType.SHARD, tensor_data=data)
        )
    return items


def _tensor_items(tensors: dict[str, TensorStorageMetadata]) -> list[WriteItem]:
    """One item per tensor, whole."""
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size([0] * len(value.size))),
            type=WriteItemType.TENSOR,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size([0] * len(value.size)), value.size),
                properties=value.properties,
                size=value.size,
            ),
        )
        for fqn, value in tensors.items()
    ]


def _files_of(tensors: dict[str, TensorStorageMetadata]) -> dict[str, int]:
    """Each tensor's safetensors file (1-based), in key order, a new file once one would pass the bound."""
    mapping, index, used = {}, 1, 0
    for fqn in sorted(tensors):
        value = tensors[fqn]
        size = value.size.numel() * torch.empty((), dtype=value.properties.dtype).element_size()
        if used and used + size > SAFETENSORS_FILE_BYTES:
            index, used = index + 1, 0
        mapping[fqn] = index
        used += size
    return mapping


def _write(writer: StorageWriter, items: list[WriteItem], source: _Source, metadata: Metadata) -> None:
    """What ``dcp.save`` does with one rank's plan, given the items: plan, write, then the metadata."""
    writer.set_up_storage_writer(True)
    plan = writer.prepare_global_plan([writer.prepare_local_plan(SavePlan(items))])[0]
    results = writer.write_data(plan, cast(SavePlanner, source)).wait()
    state = {fqn: metadata.state_dict_metadata[fqn] for fqn in {item.index.fqn for item in items}}
    writer.finish(Metadata(state_dict_metadata=state, storage_meta=StorageMeta()), [results])
