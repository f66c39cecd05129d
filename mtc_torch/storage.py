"""DCP storage for one local rank's self-contained checkpoint (``<step>/rank-<r>-of-<W>/``): the files and the writer.

The files are DCP's layout: ``__0_<k>.distcp`` data files (at most :data:`DEFAULT_FILES`) and ``.metadata``, DCP's
pickled ``Metadata`` (torch's ``FileSystemWriter.finish`` writes it). A tensor item is stored as its raw bytes (C
order, the machine's byte order), marked by :data:`RAW_TENSOR_BYTES` in its ``_StorageInfo.transform_descriptors``,
so :class:`mtc_torch.reader.StepReader` reads it straight into the destination's memory; torch's own
``FileSystemReader`` refuses such an item with ``Unknown extension name='mtc_torch.raw_tensor_bytes'``. Other items
(DCP's ``BYTE_IO``: numbers, strings, dataloader state) are DCP's own ``torch.save`` bytes.

:class:`DeterministicWriter` writes those files, several at once. Why not torch's ``FileSystemWriter(thread_count=N)``:
it serializes each tensor with ``torch.save`` (a zip record with a CRC-32) and wrote 16.9 GB in 8.2 s with 8 threads on
an H200 host, where raw writes by 8 threads reach 16.5 GB/s; raw bytes also spare a restore ``torch.load``.

Every byte depends only on the state dict and the number of files: torch puts a random ``save_id`` (uuid4) and the
absolute checkpoint path into ``.metadata``, and records whether each staged tensor was pinned; this writer leaves
them out, so data-parallel replicas (or one node saving twice) write byte-identical steps, which the agent's dedup
compares.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import io
import os
import pickle
import stat
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mtc_torch.protocol import METADATA_FILE

MAX_METADATA_BYTES = 256 * 1024 * 1024
"""The largest ``.metadata`` :class:`mtc_torch.reader.StepReader` reads, in bytes."""

RAW_TENSOR_BYTES = "mtc_torch.raw_tensor_bytes"
"""The ``transform_descriptors`` entry of a tensor item stored as its raw bytes."""

DEFAULT_FILES = 8
"""How many data files a rank's checkpoint is spread over: as many as the writer threads that reach about 16 GB/s
into tmpfs on an H200 host (the probe in docs/pytorch.md)."""

_WRITE_BYTES = 1 << 30  # one write(2) at most: Linux moves at most 2 GiB - 4 KiB per call

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),  # how torch.strided pickles: a lookup by name among torch's layouts
}


class DeterministicWriter(FileSystemWriter):
    """DCP's ``StorageWriter`` for a rank's directory: raw tensor bytes in up to ``files`` files, written in parallel.

    Args:
        path: the rank's directory, ``<local>/<step>.tmp/rank-<r>-of-<W>``.
        files: how many data files the items are spread over (by size, deterministically); keep it the same on
            data-parallel replicas, whose steps must be byte-identical.
        threads: how many files are written at once.
        sync_files: fsync each file (a no-op on tmpfs).

    Tensors in GPU memory are copied to the host first, synchronously: :class:`mtc_torch.staging.HostStager` is
    the fast way there.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, files: int = DEFAULT_FILES, threads: int = 1, sync_files: bool = True
    ) -> None:
        if files < 1 or threads < 1:
            raise ValueError(f"files and threads must be >= 1, got {files} and {threads}")
        super().__init__(path, sync_files=sync_files)
        self.files = files
        self.threads = threads

    def storage_meta(self) -> StorageMeta | None:
        """An empty ``StorageMeta``: the same for every save of the same state dict."""
        return StorageMeta()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes every item of ``plan``; the future is done when every file is written (and synced)."""
        prefix = plan.storage_data.prefix
        blobs = [_Blob.of(item, planner.resolve_data(item)) for item in plan.items]
        files = _spread(blobs, self.files)
        with concurrent.futures.ThreadPoolExecutor(
            min(self.threads, max(1, len(files))), thread_name_prefix="mtc-torch-write"
        ) as pool:
            written = pool.map(lambda k: self._write_file(f"{prefix}{k}{DEFAULT_SUFFIX}", files[k]), range(len(files)))
            results = [result for file_results in written for result in file_results]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Writes ``.metadata`` with each tensor's deprecated ``pin_memory`` and ``requires_grad`` cleared: they
        tell where the staged copy lay (pinned or not, a parameter or its copy), not what the checkpoint holds."""
        for value in metadata.state_dict_metadata.values():
            if isinstance(value, TensorStorageMetadata):
                value.properties.pin_memory = False
                value.properties.requires_grad = False
        super().finish(metadata, results)

    def _write_file(self, name: str, blobs: list[_Blob]) -> list[WriteResult]:
        results = []
        offset = 0
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            for blob in blobs:
                view = blob.data
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done : done + _WRITE_BYTES])
                results.append(
                    WriteResult(
                        index=blob.item.index,
                        size_in_bytes=len(view),
                        storage_data=_StorageInfo(name, offset, len(view), transform_descriptors=blob.descriptors),
                    )
                )
                offset += len(view)
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        return results


@dataclasses.dataclass(frozen=True)
class _Blob:
    """One write item's bytes as they go into a file."""

    item: WriteItem
    data: memoryview
    descriptors: list[str] | None

    @classmethod
    def of(cls, item: WriteItem, data: torch.Tensor | io.BytesIO) -> _Blob:
        if isinstance(data, io.BytesIO):
            return cls(item, data.getbuffer(), None)
        tensor = data.detach().cpu()
        if tensor.layout != torch.strided or tensor.is_quantized:  # no raw form: DCP's own torch.save bytes
            stream = io.BytesIO()
            torch.save(tensor, stream)
            return cls(item, stream.getbuffer(), None)
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        return cls(item, memoryview(flat.numpy()), [RAW_TENSOR_BYTES])  # type: ignore[arg-type]  # as reader.read_into


def _spread(blobs: list[_Blob], files: int) -> list[list[_Blob]]:
    """Blobs over at most ``files`` files, each largest-first into the file holding the fewest bytes (ties: the
    lowest number); within a file, in plan order. Depends only on the blobs' sizes and order."""
    order = sorted(range(len(blobs)), key=lambda i: (-len(blobs[i].data), i))
    loads = [(0, k) for k in range(min(files, len(blobs)))]
    heapq.heapify(loads)
    chosen: list[list[int]] = [[] for _ in loads]
    for i in order:
        load, k = heapq.heappop(loads)
        chosen[k].append(i)
        heapq.heappush(loads, (load + len(blobs[i].data), k))
    return [[blobs[i] for i in sorted(indices)] for indices in chosen]


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata":  # its dataclasses and enums, never a function
            value = super().find_class(module, name)
            if isinstance(value, type):
                return value
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{METADATA_FILE} refers to {module}.{name}, which a DCP checkpoint never does")


def load_metadata(path: str | os.PathLike[str], limit: int = MAX_METADATA_BYTES) -> Metadata:
    """Reads a DCP ``.metadata`` file with a size bound and an allow-list unpickler.

    Raises:
        ValueError: larger than ``limit`` bytes, not a regular file (a symlink is refused), or not DCP metadata.
        pickle.UnpicklingError: it names a class outside the allow-list.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} holds {info.st_size} bytes, more than the {limit} a checkpoint's metadata may")
        data = file.read(limit + 1)
    metadata = _AllowListUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} is not DCP metadata but a {type(metadata).__name__}")
    return metadata
