"""Writing a step as it is received into the ramdisk (from a peer or from the backup tier): each
file is created at its full size, then written in place range by range, by several threads at once."""

import os


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> int:
    """Writes all of ``data`` to ``fd`` at ``offset`` (``os.pwrite`` may write less than asked);
    returns the offset after it.

    Raises:
      OSError: a write failed, e.g. ENOSPC.
    """
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return offset
