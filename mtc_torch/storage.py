"""DCP storage for one local rank's self-contained checkpoint (``<step>/rank-<r>-of-<W>/``).

:class:`DeterministicWriter` is torch's ``FileSystemWriter`` with a ``.metadata`` that depends only on the state
dict: torch puts a random ``save_id`` (uuid4) and the absolute checkpoint path into it, so two data-parallel
replicas (or one node saving twice) would write different bytes; the agent's dedup compares bytes.

:class:`BoundedReader` is torch's ``FileSystemReader`` that refuses a ``.metadata`` larger than a bound and
unpickles it with an allow-list of classes (DCP's metadata types, ``torch.Size``, dtypes and builtins), since a
restored step may come from another node or the backup tier. Tensor data is read by torch with
``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mtc_torch.protocol import METADATA_FILE

MAX_METADATA_BYTES = 256 * 1024 * 1024
"""The largest ``.metadata`` :class:`BoundedReader` reads, in bytes."""

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
    """``FileSystemWriter`` whose ``.metadata`` holds no random ``save_id`` and no absolute path.

    Args:
        path: the rank's directory, ``<local>/<step>.tmp/rank-<r>-of-<W>``.
        **kwargs: passed to ``FileSystemWriter`` (``single_file_per_rank``, ``sync_files``, ``thread_count``...).
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)

    def storage_meta(self) -> StorageMeta | None:
        """An empty ``StorageMeta``: the same for every save of the same state dict."""
        return StorageMeta()


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


class BoundedReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` through :func:`load_metadata`.

    Args:
        path: the rank's directory, ``<local>/step=<step>/rank-<r>-of-<W>``.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, bounded and allow-listed; ``load_id`` set as torch's reader does."""
        metadata = load_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
