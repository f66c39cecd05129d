"""DCP's ``StorageReader`` for a step in any of its layouts: merged metadata, and raw tensor bytes read in parallel.

:class:`StepReader` reads one rank's directory, a node's step or a multi-node step
(:mod:`mtc_torch.step_layout`); its metadata is every present rank's ``.metadata`` merged into DCP's global
``Metadata``, so ``dcp.load`` reshards: it loads a step into any world size and mesh whose wanted elements the
present ranks store.

Why not torch's ``FileSystemReader``: it reads each item with one thread into pageable memory, ``torch.load``s it and
copies it to the destination; into GPU memory that ran at 1.1-1.4 GB/s on an H200 host (docs/pytorch.md, "On
GPUs"), where 16 threads read tmpfs at 25 GB/s and pinned host-to-GPU copies run at 55 GB/s. Here, a tensor stored
raw (:data:`mtc_torch.storage.RAW_TENSOR_BYTES`) is read in pieces of :data:`PIECE_BYTES` by ``threads`` threads:
- into a CPU destination directly (no copy in between);
- into a GPU destination through one pinned piece per thread, each copied on that thread's CUDA stream (the pinned
  memory is ``threads`` × :data:`PIECE_BYTES`, whatever the checkpoint's size);
- into some rows of a destination, or a destination of some rows of the stored chunk (a resharded ``Shard(0)``
  load), the same way: those rows are one byte range of the file;
- into a destination of another dtype or layout, or a box that is not whole rows (``Shard(1)`` resharded), through
  one host copy of the stored chunk.
Items stored as torch's own writer stores them (``torch.save`` bytes, as ``mtc_torch`` 0.2.0 did) go through
``FileSystemReader``.

Before anything is read, every load is checked to read each element it asks for
(:func:`mtc_torch.coverage.check_coverage`): a load that the present ranks' chunks do not wholly cover (a partial
step, or a resharded load on a node that lacks another node's copy), which DCP would leave partly unread, raises
instead. Whether the bytes are the ones saved is the node agent's job (or ``mtc export``'s): it verifies every
file's checksum before a step is read.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import logging
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

from mtc_torch import step_layout
from mtc_torch.coverage import check_coverage
from mtc_torch.storage import RAW_TENSOR_BYTES

log = logging.getLogger(__name__)

PIECE_BYTES = 32 << 20
"""The bytes one thread reads at a time, and the size of each thread's pinned piece for GPU destinations."""


@dataclasses.dataclass(frozen=True)
class _Piece:
    """The bytes at ``offset`` in ``file`` that fill ``target``, a flat byte view of (part of) a destination."""

    file: str
    offset: int
    target: torch.Tensor


class StepReader(FileSystemReader):
    """``FileSystemReader`` for a step in any layout, with bounded, allow-listed metadata merged from every present
    rank, and parallel reads of raw tensor bytes.

    ``dcp.load(state_dict, storage_reader=StepReader(step_dir), no_dist=True)`` loads the step into ``state_dict``
    at any world size and mesh (``no_dist=False`` as well, when every process sees the same files).

    Args:
        path: a rank's directory (``<step>/rank-<r>-of-<W>``), a node's step (``<step>``, holding
            ``rank-<r>-of-<W>/``) or a multi-node step (holding ``node-<n>-of-<N>/rank-<r>-of-<W>/``).
        threads: how many reads run at once.
        prefer: a rank directory relative to ``path`` (``rank-1-of-4``, ``node-0-of-2/rank-1-of-4``) merged first,
            so its copy of a chunk that several ranks store, and its non-tensor items, are the ones read; None: the
            lowest (node, local rank) first. Ignored when absent.

    Raises (from ``dcp.load``, wrapped in its ``CheckpointException``):
        PartialRestoreError: the present ranks do not store every element the state dict asks for (before anything
            is read; :func:`mtc_torch.coverage.check_coverage`).
        ValueError: not a step (:func:`mtc_torch.step_layout.rank_dirs`), a rank's metadata is missing, refused or
            disagrees with another's (:func:`mtc_torch.step_layout.merge_metadata`), an item's stored length is not
            what its shape and dtype give, or a file is shorter than its items.
        TypeError: the load's planner is not a ``DefaultLoadPlanner`` (the check needs its state dict).
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 1, prefer: str | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        super().__init__(path)
        self.threads = threads
        self.prefer = prefer
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._merged: Metadata | None = None
        self._refusal_logged = False

    def rank_dirs(self) -> list[step_layout.RankDir]:
        """The step's rank directories in the order their metadata is merged: ``prefer`` first."""
        found = step_layout.rank_dirs(self.path)
        return sorted(found, key=lambda d: d.relative != self.prefer)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's merged metadata (:func:`mtc_torch.step_layout.merge_metadata`), merged once per path;
        ``load_id`` set as torch's reader does.

        Called before ``dcp.load``, it raises a malformed step's ``ValueError`` itself: within ``dcp.load`` the
        error reaches the caller only as the message of DCP's ``AssertionError("metadata is None; ...")``, and
        torch 2.11's leaves it out (``"metadata is None"``), so it is also logged, once per reader, at ERROR.
        """
        if self._merged is None:
            try:
                self._merged = step_layout.merge_metadata(self.path, self.rank_dirs())
            except ValueError as error:
                if not self._refusal_logged:  # DCP asks twice: the global metadata, then the rank's
                    log.error("%s", error)
                    self._refusal_logged = True
                raise
        self._merged.storage_meta = StorageMeta(load_id=self.load_id)
        return self._merged

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._merged = None

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
            raise TypeError(f"StepReader needs a DefaultLoadPlanner, whose state dict it checks; got {planner!r}")
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

    def open_files(self) -> _Files:
        """Every data file of the step, open for :meth:`read_item` (after ``set_up_storage_reader``)."""
        return _Files(self.path, {info.relative_path for info in self.storage_data.values()})

    def read_item(self, files: _Files, index: MetadataIndex) -> torch.Tensor | io.BytesIO:
        """The item stored at ``index`` as it was saved: a tensor chunk (CPU, its stored dtype and sizes) or a
        non-tensor item's ``torch.save`` bytes.

        Raises:
            ValueError: as :meth:`read_data`, or the item is stored with a transform ``mtc_torch`` never writes.
        """
        info = self.storage_data[index]
        descriptors = tuple(info.transform_descriptors or ())
        if descriptors not in ((), (RAW_TENSOR_BYTES,)):
            raise ValueError(f"{self.path}: {index.fqn} is stored with transforms {list(descriptors)}")
        if descriptors:
            dtype, sizes = self._stored(index, info.length)
            tensor = torch.empty(sizes, dtype=dtype)
            files.read_into(info.relative_path, info.offset, tensor.reshape(-1).view(torch.uint8))
            return tensor
        data = torch.empty(info.length, dtype=torch.uint8)
        files.read_into(info.relative_path, info.offset, data)
        stream = io.BytesIO(data.numpy().tobytes())
        if index.fqn in self._tensors:  # a tensor as torch's own writer stores it (mtc_torch 0.2.0)
            return torch.load(stream, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
        return stream

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
            start = _contiguous_start(item, sizes, dtype)
            if (
                start is not None
                and tuple(target.shape) == tuple(item.lengths)
                and target.dtype == dtype
                and target.is_contiguous()
                and target.layout == torch.strided
            ):  # the wanted rows of the stored chunk are one byte range: read it in place, as a whole chunk is
                flat = target.reshape(-1).view(torch.uint8)
                pieces += [
                    _Piece(info.relative_path, info.offset + start + at, flat[at : at + PIECE_BYTES])
                    for at in range(0, flat.numel(), PIECE_BYTES)
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


def _contiguous_start(item: ReadItem, sizes: torch.Size, dtype: torch.dtype) -> int | None:
    """Where the box ``item`` wants starts in its stored chunk's bytes, when the box is one byte range there
    (whole in every dimension but the first: a load of the chunk itself, or of some of its rows, as FSDP's
    ``Shard(0)`` at another world size asks), else None."""
    whole = zip(item.storage_offsets[1:], item.lengths[1:], sizes[1:], strict=True)
    if any(offset != 0 or length != size for offset, length, size in whole):
        return None
    return item.storage_offsets[0] * math.prod(sizes[1:]) * dtype.itemsize if sizes else 0


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
