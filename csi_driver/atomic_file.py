"""The one crash-safe file write: a file is replaced whole or not at all, and survives a power loss.

Every write goes to an exclusive, randomly named temporary file in the same directory, is fsynced,
renamed over the name (``renameat`` replaces a symlink planted at the name itself, never its
target), and the directory is fsynced so the rename is durable too.

Used for the ramdisk manager's ``state.json``, the replicator's manifests and metadata, the
coordinator's snapshot, and (through ``replicator.local_tier.pod_files``) the files written into pod-writable
directories.
"""

# It lives in csi_driver, the lowest package, so that csi_driver, replicator and the coordinator
# share it without an import cycle (csi_driver imports nothing above it).

import contextlib
import os
import secrets
from collections.abc import Callable

# Temporary names start with this; ``replicator.local_tier.pod_files.sweep_temp_files`` removes leftovers.
TEMP_PREFIX = ".mtc-tmp-"
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(dir_fd: int) -> None:
    """Makes renames and unlinks in the directory durable."""
    os.fsync(dir_fd)


def replace_with(dir_fd: int, name: str, create: Callable[[str], None]) -> None:
    """``create(tmp)`` makes an entry under a fresh random name in the directory, which then replaces
    ``name`` (a rename within ``dir_fd``); the directory is fsynced. On any failure the temporary
    entry is removed and the exception propagates, leaving ``name`` as it was."""
    tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}"
    try:
        create(tmp)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    fsync_dir(dir_fd)


def write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Replaces ``name`` in the directory ``dir_fd`` with a regular file holding ``data``: exclusive
    temp file, fsync, rename, fsync of the directory. A symlink or file planted at ``name`` is
    replaced, never written through.

    Raises:
      OSError: the write, fsync or rename failed; ``name`` is unchanged.
    """

    def create(tmp: str) -> None:
        with os.fdopen(os.open(tmp, _CREATE_FLAGS, 0o644, dir_fd=dir_fd), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    replace_with(dir_fd, name, create)


def write_file_atomic(path: str, data: bytes) -> None:
    """``write_atomic`` for a file named by path in a directory only the agent or coordinator writes
    (state files, manifests, snapshots).

    Raises:
      OSError: the directory does not exist, or the write failed; ``path`` is unchanged.
    """
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic(fd, os.path.basename(path), data)
    finally:
        os.close(fd)
