"""DCP's ``StorageReader`` for one rank's checkpoint: bounded metadata, and raw tensor bytes read in parallel.

Why not torch's ``FileSystemReader``: it reads each item with one thread into pageable memory, ``torch.load``s it and
copies it to the destination; into GPU memory that ran at 1.1-1.4 GB/s on an H200 host (docs/pytorch.md, "On
GPUs"), where 16 threads read tmpfs at 25 GB/s and pinned host-to-GPU copies run at 55 GB/s. Here, a tensor stored
raw (:data:`mtc_torch.storage.RAW_TENSOR_BYTES`) is read in pieces of :data:`PIECE_BYTES` by ``threads`` threads:
- into a CPU destination directly (no copy in between);
- into a GPU destination through one pinned piece per thread, each copied on that thread's CUDA stream (the pinned
  memory is ``threads`` × :data:`PIECE_BYTES`, whatever the checkpoint's size);
- into a destination of another shape, dtype or layout (a resharded load) through one host copy of the stored tensor.
Items stored as torch's own writer stores them (``torch.save`` bytes, as ``mtc_torch`` 0.2.0 did) go through
``FileSystemReader``.

Before anything is read, every load is checked to read each element it asks for
(:func:`mtc_torch.coverage.check_coverage`): a load into another sharding than the saved one, which DCP would leave
partly unread, raises instead. Whether the bytes are the ones saved is the node agent's job: it verifies every file's
checksum before a step reaches the job.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import os
import queue
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from mtc_torch.coverage import check_coverage
from mtc_torch.storage import RAW_TENSOR_BYTES, load_metadata

PIECE_BYTES = 32 << 20
"""The bytes one thread reads at a time, and the size of each thread's pinned piece for GPU destinations."""


@dataclasses.dataclass(frozen=True)
class _Piece:
    """The bytes at ``offset`` in ``file`` that fill ``target``, a flat byte view of (part of) a destination."""

    file: str
    offset: int
    target: torch.Tensor


class BoundedReader(FileSystemReader):
    """``FileSystemReader`` with a bounded, allow-listed ``.metadata`` and parallel reads of raw tensor bytes.

    Args:
        path: the rank's directory, ``<local>/step=<step>/rank-<r>-of-<W>``.
        threads: how many reads run at once.

    Raises (from ``dcp.load``, wrapped in its ``CheckpointException``):
        PartialRestoreError: the checkpoint does not store every element the state dict asks for (before anything
            is read; :func:`mtc_torch.coverage.check_coverage`).
        ValueError: the metadata is refused (:func:`mtc_torch.storage.load_metadata`), an item's stored length is
            not what its shape and dtype give, or a file is shorter than its items.
        TypeError: the load's planner is not a ``DefaultLoadPlanner`` (the check needs its state dict).
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        super().__init__(path)
        self.threads = threads
        self._tensors: dict[str, TensorStorageMetadata] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, bounded and allow-listed; ``load_id`` set as torch's reader does."""
        metadata = load_metadata(self._get_metadata_path(kwargs.get("rank")))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = {
            fqn: value
            for fqn, value in metadata.state_dict_metadata.items()
            if isinstance(value, TensorStorageMetadata)
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads every item of ``plan`` into the planner's destinations, once they are known to be wholly stored;
        done when the future is returned."""
        if not isinstance(planner, DefaultLoadPlanner):
            raise TypeError(f"BoundedReader needs a DefaultLoadPlanner, whose state dict it checks; got {planner!r}")
        check_coverage(planner.state_dict, self._tensors, str(self.path))
        raw = [item for item in plan.items if self._is_raw(item)]
        others = [item for item in plan.items if not self._is_raw(item)]
        if others:
            super().read_data(dataclasses.replace(plan, items=others), planner).wait()
        if raw:
            self._read_raw(raw, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _is_raw(self, item: ReadItem) -> bool:
        descriptors = self.storage_data[item.storage_index].transform_descriptors or ()
        return item.type == LoadItemType.TENSOR and RAW_TENSOR_BYTES in descriptors

    def _read_raw(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        pieces: list[_Piece] = []
        resharded: list[Callable[[_Files], None]] = []
        targets = [(item, planner.resolve_tensor(item).detach()) for item in items]
        for item, target in targets:
            info = self.storage_data[item.storage_index]
            dtype, sizes = self._stored(item.storage_index, info.length)
            if (
                all(o == 0 for o in item.storage_offsets)
                and tuple(item.lengths) == tuple(sizes)
                and tuple(target.shape) == tuple(sizes)
                and target.dtype == dtype
                and target.is_contiguous()
                and target.layout == torch.strided
            ):
                flat = target.reshape(-1).view(torch.uint8)
                pieces += [
                    _Piece(info.relative_path, info.offset + start, flat[start : start + PIECE_BYTES])
                    for start in range(0, info.length, PIECE_BYTES)
                ]
            else:
                resharded.append(self._resharded(item, info.relative_path, info.offset, dtype, sizes, target))
        for device in {target.device for _, target in targets if target.is_cuda}:
            torch.cuda.synchronize(device)  # the destinations' pending work (a zeros_like, say) before ours
        names = {self.storage_data[item.storage_index].relative_path for item in items}
        lanes = _Lanes()
        with (
            _Files(self.path, names) as files,
            concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="mtc-torch-read") as pool,
        ):
            jobs = [pool.submit(lanes.read, files, piece) for piece in pieces]
            jobs += [pool.submit(job, files) for job in resharded]
            for job in jobs:
                job.result()
        for item, target in targets:
            planner.commit_tensor(item, target)

    def _stored(self, index: MetadataIndex, length: int) -> tuple[torch.dtype, torch.Size]:
        """The dtype and shape of the stored chunk at ``index``, checked against its stored ``length``."""
        tensor = self._tensors.get(index.fqn)
        chunk = next(
            (c for c in (tensor.chunks if tensor else ()) if tuple(c.offsets) == tuple(index.offset or ())), None
        )
        if tensor is None or chunk is None:
            raise ValueError(f"{self.path}: {index.fqn} at offset {index.offset} has no chunk in the metadata")
        expected = math.prod(chunk.sizes) * torch.empty((), dtype=tensor.properties.dtype).element_size()
        if expected != length:
            raise ValueError(
                f"{self.path}: {index.fqn} is stored as {length} bytes where its shape "
                f"{list(chunk.sizes)} of {tensor.properties.dtype} makes {expected}"
            )
        return tensor.properties.dtype, chunk.sizes

    @staticmethod
    def _resharded(
        item: ReadItem, file: str, offset: int, dtype: torch.dtype, sizes: torch.Size, target: torch.Tensor
    ) -> Callable[[_Files], None]:
        def read(files: _Files) -> None:
            stored = torch.empty(sizes, dtype=dtype)
            files.read_into(file, offset, stored.reshape(-1).view(torch.uint8))
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                stored = stored.narrow(dim, start, length)
            target.copy_(stored)

        return read


class _Files:
    """The checkpoint's data files, each opened once (never through a symlink), read with ``preadv``."""

    def __init__(self, directory: str | os.PathLike[str], names: set[str]) -> None:
        self._directory = directory
        self._fds: dict[str, int] = {}
        try:
            for name in sorted(names):
                self._fds[name] = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read_into(self, name: str, offset: int, target: torch.Tensor) -> None:
        """Fills ``target`` (a flat uint8 CPU tensor) with the bytes of ``name`` from ``offset``."""
        view = memoryview(target.numpy())  # type: ignore[arg-type]  # numpy's stubs declare no buffer protocol before 3.12
        done = 0
        while done < len(view):
            got = os.preadv(self._fds[name], [view[done:]], offset + done)
            if got == 0:
                raise ValueError(f"{self._directory}/{name} ends at {offset + done} bytes, before its items do")
            done += got


class _Lanes:
    """Pinned pieces and CUDA streams for destinations in GPU memory. A reading thread holds one at a time and
    returns it, so there are at most as many as threads (``threads`` × :data:`PIECE_BYTES` pinned bytes)."""

    def __init__(self) -> None:
        self._free: dict[torch.device, queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Stream]]] = (
            collections.defaultdict(queue.SimpleQueue)
        )

    def read(self, files: _Files, piece: _Piece) -> None:
        if not piece.target.is_cuda:
            files.read_into(piece.file, piece.offset, piece.target)
            return
        free = self._free[piece.target.device]
        try:
            buffer, stream = free.get_nowait()
        except queue.Empty:
            buffer = torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True)
            stream = torch.cuda.Stream(device=piece.target.device)
        try:
            host = buffer[: piece.target.numel()]
            files.read_into(piece.file, piece.offset, host)
            with torch.cuda.stream(stream):
                piece.target.copy_(host, non_blocking=True)
            stream.synchronize()  # the pinned piece is filled again only after its copy is done
        finally:
            free.put((buffer, stream))
