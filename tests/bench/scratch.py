"""A bench's scratch directory: whatever it mounts or starts is undone and the directory removed,
on success or error."""

import contextlib
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
