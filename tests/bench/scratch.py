"""A bench's scratch: a directory whose mounts and processes are undone and which is removed on
success or error, and free loopback ports."""

import contextlib
import socket
import subprocess
import tempfile
from collections.abc import Iterator

from examples.local_cluster import unmount_all_below


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[tuple[str, contextlib.ExitStack]]:
    """Yields (directory, ExitStack). Callbacks added to the stack run first, in reverse order;
    then every mount below the directory is unmounted and the directory removed."""
    with contextlib.ExitStack() as cleanup:
        workdir = tempfile.mkdtemp(prefix=prefix)
        cleanup.callback(subprocess.run, ["rm", "-rf", "--one-file-system", workdir], check=False)
        cleanup.callback(unmount_all_below, workdir)
        yield workdir, cleanup


def free_port(host: str) -> int:
    """A port the kernel reports free on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
