"""The one way the agent touches a directory the training pod can write.

The agent runs as root and the pod owns its client directory, so every name in it may be a planted
symlink, hard link, FIFO, socket or device, and may be swapped between two calls. The kernel's
answer is the directory file descriptor: open the directory once, then resolve each name relative
to it with ``O_NOFOLLOW`` (``*at`` calls), ``fstat`` what was opened, and accept only regular files
and directories. A path string is never handed to ``open``, ``rename`` or ``rmtree`` for a name the
pod controls. Everything here raises ``UnsafeEntry`` (an ``OSError``) for anything else, and never
blocks on a FIFO (``O_NONBLOCK``).

Writes are ``csi_driver.atomic_file``'s: an exclusive, randomly named temporary file, fsynced and
renamed into place (``renameat`` replaces a planted symlink itself, never its target); the directory
is fsynced too.
"""

import contextlib
import errno
import os
import re
import shutil
import stat
from collections.abc import Iterator

from csi_driver import atomic_file
from csi_driver.atomic_file import TEMP_PREFIX, replace_with

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# A step directory of more entries than this is refused rather than walked (Orbax writes tens).
MAX_STEP_ENTRIES = 100_000
# Names are ASCII digits only: str.isdigit() and \d also accept '²' or '٣', which int() rejects or aliases.
_ASCII_INT = re.compile(r"[0-9]{1,18}", re.ASCII)


class UnsafeEntry(OSError):
    """A name in a pod-writable directory is not what the agent may use: a symlink, FIFO, socket,
    device, an unreadable name, or a tree too large to walk. The message names the entry."""


def parse_int_name(text: str) -> int | None:
    """``text`` as a non-negative integer if it is 1-18 ASCII digits, else None (never raises)."""
    return int(text) if _ASCII_INT.fullmatch(text) else None


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file or directory"


@contextlib.contextmanager
def open_dir(path: str, name: str | None = None, dir_fd: int | None = None) -> Iterator[int]:
    """Opens a directory without following a symlink at its last component; closes it afterwards.

    Args:
      path: the directory (its last component must be a real directory), or with ``dir_fd`` a
        single name inside that directory.

    Raises:
      UnsafeEntry: it is a symlink or not a directory.
      FileNotFoundError: it does not exist.
    """
    target = path if name is None else name
    try:
        fd = os.open(target, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntry(err.errno, f"{target} is not a directory (a symlink or another kind of file)") from None
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def lstat(dir_fd: int, name: str) -> os.stat_result | None:
    """The entry's own status (a symlink is not followed), or None when it does not exist."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def is_dir(dir_fd: int, name: str) -> bool:
    """True when ``name`` is a real directory (not a symlink to one)."""
    found = lstat(dir_fd, name)
    return found is not None and stat.S_ISDIR(found.st_mode)


def open_regular(dir_fd: int, name: str) -> int:
    """Opens a regular file for reading; the caller closes the descriptor.

    Raises:
      UnsafeEntry: it is anything but a regular file.
      FileNotFoundError: it does not exist.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeEntry(err.errno, f"{name} is a symlink") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeEntry(errno.EINVAL, f"{name} is {_kind(mode)}")
    return fd


def open_relative(root_fd: int, rel: str) -> int:
    """Opens the regular file ``rel`` (``a/b/c``) below ``root_fd``, every component without
    following a symlink. The caller closes the descriptor.

    Raises:
      UnsafeEntry: a component is a symlink or the file is not regular.
      FileNotFoundError: it does not exist.
    """
    *parents, leaf = rel.split("/")
    with contextlib.ExitStack() as stack:
        fd = root_fd
        for part in parents:
            fd = stack.enter_context(open_dir(part, dir_fd=fd))
        return open_regular(fd, leaf)


def read_small(dir_fd: int, name: str, limit_bytes: int) -> tuple[bytes, os.stat_result] | None:
    """Reads a small regular file written by the pod: its bytes and the ``fstat`` of the descriptor
    they were read from; None when it does not exist.

    Raises:
      UnsafeEntry: it is not a regular file, or is larger than ``limit_bytes``.
    """
    try:
        fd = open_regular(dir_fd, name)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(fd)
        data = f.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise UnsafeEntry(errno.EFBIG, f"{name} is larger than {limit_bytes} bytes")
    return data, status


def read_text(dir_fd: int, name: str, limit_bytes: int) -> str | None:
    """Reads a small regular file written by the pod, or None when it does not exist.

    Raises:
      UnsafeEntry: it is not a regular file, or is larger than ``limit_bytes``.
      UnicodeDecodeError: it is not UTF-8.
    """
    found = read_small(dir_fd, name, limit_bytes)
    return None if found is None else found[0].decode("utf-8")


# The pod-directory writes are the shared crash-safe ones, named here too so that every I/O in a
# pod-writable directory goes through this module. ``write_file_atomic`` is for agent-owned
# directories: new code takes it from ``csi_driver.atomic_file`` (job_meta and the coordinator still
# call it here).
fsync_dir = atomic_file.fsync_dir
write_atomic = atomic_file.write_atomic
write_file_atomic = atomic_file.write_file_atomic


def write_symlink(dir_fd: int, name: str, target: str) -> None:
    """Atomically makes ``name`` a symlink to ``target`` (a name in the same directory)."""
    replace_with(dir_fd, name, lambda tmp: os.symlink(target, tmp, dir_fd=dir_fd))


def remove(dir_fd: int, name: str) -> bool:
    """Removes ``name`` whatever it is (a tree is removed without following any symlink in it).

    Returns:
      False when it did not exist.
    """
    found = lstat(dir_fd, name)
    if found is None:
        return False
    if stat.S_ISDIR(found.st_mode):
        # fd-based: never follows a link (rmtree.avoids_symlink_attacks). The job may delete the same
        # tree at once (NeMo's start-up removes its unfinished saves): what vanished meanwhile is no
        # error, and only what is left afterwards is tried again for its real error.
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
        if lstat(dir_fd, name) is not None:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(name, dir_fd=dir_fd)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
    return True


def sweep_temp_files(dir_fd: int) -> None:
    """Removes temporary files an interrupted ``write_atomic`` left behind."""
    for entry in os.scandir(dir_fd):
        if entry.name.startswith(TEMP_PREFIX):
            remove(dir_fd, entry.name)


def names(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """Every entry of the directory with its own (not followed) status."""
    found = []
    for entry in os.scandir(dir_fd):
        with contextlib.suppress(FileNotFoundError):
            found.append((entry.name, entry.stat(follow_symlinks=False)))
    return found


def _check_name(rel: str) -> str:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeEntry(errno.EINVAL, f"{rel.encode('utf-8', 'surrogateescape')!r} is not a UTF-8 name") from None
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in rel):
        raise UnsafeEntry(errno.EINVAL, f"{rel!r} holds a control character or backslash")
    return rel


def walk_files(root_fd: int) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Every regular file below ``root_fd``, depth first in name order, never following a link.

    Yields:
      (relative posix path, descriptor of its directory (valid until the next item), name, status).

    Raises:
      UnsafeEntry: an entry is neither a regular file nor a directory, has an unusable name, or the
        tree holds more than ``MAX_STEP_ENTRIES`` entries.
    """
    count = 0

    def walk(fd: int, prefix: str) -> Iterator[tuple[str, int, str, os.stat_result]]:
        nonlocal count
        for name, status in sorted(names(fd)):
            count += 1
            if count > MAX_STEP_ENTRIES:
                raise UnsafeEntry(errno.EFBIG, f"more than {MAX_STEP_ENTRIES} entries")
            rel = _check_name(prefix + name)
            if stat.S_ISDIR(status.st_mode):
                with open_dir(name, dir_fd=fd) as child:
                    yield from walk(child, rel + "/")
            elif stat.S_ISREG(status.st_mode):
                yield rel, fd, name, status
            else:
                raise UnsafeEntry(errno.EINVAL, f"{rel} is {_kind(status.st_mode)}")

    yield from walk(root_fd, "")


def proc_path(fd: int) -> str:
    """A path that reopens exactly the file behind ``fd`` (``/proc/self/fd/N``), for libraries that
    take file names: a name swapped after the check cannot redirect them."""
    return f"/proc/self/fd/{fd}"
