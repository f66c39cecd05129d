"""Host copies of a rank's state dict for a save: allocated once, refilled by every save, pinned next to a GPU.

A save blocks training only while the state is copied out of the tensors the trainer changes. Out of GPU memory that
copy runs at about 1.1 GB/s into pageable host memory and at about 55 GB/s into page-locked (pinned) memory, on an
H200 (docs/pytorch.md, "On GPUs"). Pinning costs seconds for tens of GB, so the buffers are pinned once and reused
for as long as each tensor keeps its shape and dtype; the copies run on a side CUDA stream.

Why not DCP's own stagers: ``BlockingAsyncStager`` (what ``dcp.async_save`` uses by default) copies into pageable
memory; ``DefaultStager(StagingOptions(use_pinned_memory=True, ...))`` pins new memory for every save unless it is
reused, and a reused one failed on the second save in torch 2.11 (``KeyError: <class 'type'>`` in
``_state_dict_stager._reconstruct``).

Buffers are pinned with ``cudaHostRegister`` on memory of the exact size (``torch.empty(..., pin_memory=True)``
rounds each allocation up to a power of two, up to twice the memory), as torch's own ``_state_dict_stager`` does.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

_Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Buffer:
    tensor: torch.Tensor
    pinned: bool


def _unpin(pinned: dict[int, torch.Tensor]) -> None:
    """Unregisters every pinned buffer; the dict holds them alive until then (memory is never freed pinned)."""
    for pointer in list(pinned):
        torch.cuda.cudart().cudaHostUnregister(pointer)
        del pinned[pointer]


class HostStager:
    """Copies a state dict's tensors into host buffers it keeps, one per tensor, reused by every save.

    A tensor in GPU memory is copied into pinned memory on a side CUDA stream, asynchronously; a CPU tensor is copied
    at once. Anything else (numbers, strings, ``BytesIO``) is deep-copied. Containers (dict, list, tuple) keep their
    shape, and a tensor subclass that flattens into inner tensors (``DTensor``) is rebuilt around host copies of them.

    Args:
        pinned_limit_bytes: the most host memory, in bytes, this stager pins (None: no limit). Tensors past it are
            staged into pageable memory, about 50× slower to copy out of a GPU, with one warning.

    Not thread-safe: one save stages at a time (:class:`mtc_torch.CheckpointManager` keeps one save in flight).
    """

    def __init__(self, pinned_limit_bytes: int | None = None) -> None:
        if pinned_limit_bytes is not None and pinned_limit_bytes < 0:
            raise ValueError(f"pinned_limit_bytes must be >= 0 or None, got {pinned_limit_bytes}")
        self.pinned_limit_bytes = pinned_limit_bytes
        self._buffers: dict[_Path, _Buffer] = {}
        self._pinned: dict[int, torch.Tensor] = {}
        self._unpin_all = weakref.finalize(self, _unpin, self._pinned)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._copied: list[torch.cuda.Event] = []
        self._used: set[torch.device] = set()  # devices the current stage copies from
        self._seen: set[_Path] = set()  # buffers the current stage fills
        self._warned_unpinned = False

    @property
    def pinned_bytes(self) -> int:
        """Host memory this stager holds pinned, in bytes."""
        return sum(t.numel() * t.element_size() for t in self._pinned.values())

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Starts copying ``state_dict`` into this stager's buffers and returns the copy.

        The GPU copies are ordered after the work already queued on each device's current stream, so they see the
        values as of this call. Call :meth:`wait` before the copy is read or the originals are changed.

        Returns:
            A dict of the same shape whose tensors are this stager's host buffers (the same storage at every save
            while a tensor's shape and dtype hold).
        """
        self.wait()
        self._used, self._seen = set(), set()
        staged: dict[str, Any] = self._copy(state_dict, ())
        self._copied = [self._streams[device].record_event() for device in self._used]
        for path in [path for path in self._buffers if path not in self._seen]:  # tensors the state no longer has
            self._release(self._buffers.pop(path))
        return staged

    def wait(self) -> None:
        """Blocks until the copies of the last :meth:`stage` are done (at once on CPU); safe to call again."""
        for event in self._copied:
            event.synchronize()

    def close(self) -> None:
        """Waits for the copies and releases every buffer (unpinning what was pinned)."""
        self.wait()
        self._copied = []
        self._buffers.clear()
        self._unpin_all()

    def _copy(self, value: Any, path: _Path) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), path)
        if isinstance(value, Mapping):
            items = [(k, self._copy(v, (*path, k))) for k, v in value.items()]
            return collections.OrderedDict(items) if isinstance(value, collections.OrderedDict) else dict(items)
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy_tensor(self, tensor: torch.Tensor, path: _Path) -> torch.Tensor:
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None and type(tensor) is not torch.Tensor:  # DTensor: host copies of its local tensors
            names, context = flatten()
            inner = {name: getattr(tensor, name) for name in names}  # torch >= 2.13 lists its device mesh too
            inner = {
                name: self._copy_tensor(value, (*path, name)) if isinstance(value, torch.Tensor) else value
                for name, value in inner.items()
            }
            return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())  # type: ignore[attr-defined,no-any-return]  # a subclass hook
        if tensor.layout != torch.strided or tensor.is_quantized:  # rare layouts: a plain, synchronous copy
            return tensor.to("cpu", copy=True)
        buffer = self._buffer(path, tensor)
        if tensor.is_cuda:
            stream = self._stream(tensor.device)
            with torch.cuda.stream(stream):
                buffer.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # the allocator must not hand its memory out before the copy ran
        else:
            buffer.copy_(tensor)
        return buffer

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        if device not in self._used:
            stream.wait_stream(torch.cuda.current_stream(device))
            self._used.add(device)
        return stream

    def _buffer(self, path: _Path, tensor: torch.Tensor) -> torch.Tensor:
        self._seen.add(path)
        held = self._buffers.get(path)
        if held is not None and held.tensor.shape == tensor.shape and held.tensor.dtype == tensor.dtype:
            return held.tensor
        if held is not None:
            self._release(held)
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
        nbytes = buffer.numel() * buffer.element_size()
        pin = tensor.is_cuda and nbytes > 0
        if pin and self.pinned_limit_bytes is not None and self.pinned_bytes + nbytes > self.pinned_limit_bytes:
            pin = False
            if not self._warned_unpinned:
                self._warned_unpinned = True
                log.warning(
                    "pinned staging memory would pass its limit of %d bytes: %s and any tensor past it are "
                    "staged in pageable memory, a slower copy out of the GPU (raise pinned_limit_bytes, or "
                    "give the pod the memory)",
                    self.pinned_limit_bytes,
                    ".".join(map(str, path)),
                )
        if pin:
            status = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
            if status != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {status}")
            self._pinned[buffer.data_ptr()] = buffer
        self._buffers[path] = _Buffer(buffer, pin)
        return buffer

    def _release(self, held: _Buffer) -> None:
        if held.pinned:
            pointer = held.tensor.data_ptr()
            torch.cuda.cudart().cudaHostUnregister(pointer)
            del self._pinned[pointer]
