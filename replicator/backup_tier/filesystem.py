"""The ``file://`` backend: objects are plain files below a directory (a local disk, NFS, a test).

Object ``a/b`` is the file ``<root>/a/b``. Every write goes to a temporary sibling
(``<name>.tmp-<hex>``), is fsynced, checked, and renamed over the name (``create_text``: hard-linked
to it, which fails if the name exists), so a reader sees a whole object or none; an interrupted
write leaves only the temporary file, which ``delete_step`` removes with the rest of its step.
"""

import contextlib
import os
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence

import google_crc32c

from replicator.backup_tier.object_store import (
    BackupError,
    ObjectStore,
    Upload,
    run_parallel,
    store_errors,
    uploads_failed,
)
from replicator.local_tier.incoming import pwrite_all

_CHUNK_BYTES = 4 << 20


class FileObjects(ObjectStore):
    """Objects as files below ``root``.

    Args:
      root: an absolute directory; created on the first write.
    """

    def __init__(self, root: str):
        self.root = root.rstrip("/") or "/"
        self.url = f"file://{self.root}"

    @classmethod
    def from_url(cls, url: str, *, endpoint: str | None = None) -> "FileObjects":
        """``file:///PATH`` -> FileObjects(PATH). A directory has no endpoint: ``endpoint`` must be None.

        Raises:
          ValueError: a host, query or fragment, no absolute path, or an endpoint.
        """
        if endpoint is not None:
            raise ValueError(f"{url!r}: a file:// store takes no endpoint, got {endpoint!r}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "file" or parts.netloc or parts.query or parts.fragment or not parts.path.startswith("/"):
            raise ValueError(f"{url!r} is not file:///ABSOLUTE/PATH")
        return cls(parts.path)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def _errors(self, name: str, what: str) -> contextlib.AbstractContextManager[None]:
        return store_errors(self.url, name, what, (OSError,))

    def _write_atomically(
        self, name: str, chunks: Iterator[bytes], expected: tuple[int, str] | None, replace: bool = True
    ) -> bool:
        """Writes ``chunks`` to a temporary sibling, fsyncs, checks (size, CRC32C hex) if given, and
        renames it over ``name``; without ``replace`` links it to ``name`` instead, unless ``name`` exists.

        Returns:
          False when ``replace`` is off and ``name`` existed (nothing changed), else True.

        An ``OSError`` raised by ``chunks`` (reading a local source) propagates unchanged.
        """
        path = self._path(name)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        checksum, size = google_crc32c.Checksum(), 0
        try:
            with self._errors(name, "write"):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                out = open(tmp, "wb")
            with out:
                for chunk in chunks:
                    checksum.update(chunk)
                    size += len(chunk)
                    with self._errors(name, "write"):
                        out.write(chunk)
                with self._errors(name, "write"):
                    out.flush()
                    os.fsync(out.fileno())
            actual = (size, checksum.digest().hex())
            if expected is not None and actual != expected:
                raise BackupError(
                    f"{self.url}/{name}: wrote {actual[0]} bytes with crc32c {actual[1]}, "
                    f"manifest says {expected[0]} bytes with {expected[1]}"
                )
            with self._errors(name, "write"):
                if replace:
                    os.replace(tmp, path)
                    return True
                try:
                    os.link(tmp, path)  # atomic, and never replaces
                    return True
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            self._prune(os.path.dirname(path))
            raise

    def _put(self, upload: Upload) -> None:
        with open(upload.local_path, "rb") as source:
            self._write_atomically(
                upload.name, iter(lambda: source.read(_CHUNK_BYTES), b""), (upload.size, upload.crc32c)
            )

    def put_files(
        self, uploads: Sequence[Upload], workers: int, stored: Callable[[Upload], None] | None = None
    ) -> None:
        failures: list[str] = []

        def put(upload: Upload) -> None:
            try:
                self._put(upload)
            except BackupError as exc:
                failures.append(f"{upload.name}: {exc}")
                return
            if stored is not None:
                stored(upload)

        run_parallel(put, uploads, workers)
        if failures:
            raise uploads_failed(self.url, sorted(failures), len(uploads))

    def download_range(self, name: str, start: int, length: int, dest_fd: int) -> None:
        with self._errors(name, "read"):
            source = os.open(self._path(name), os.O_RDONLY)
        try:
            offset, end = start, start + length
            while offset < end:
                with self._errors(name, "read"):
                    chunk = os.pread(source, min(_CHUNK_BYTES, end - offset), offset)
                if not chunk:
                    raise BackupError(f"{self.url}/{name}: object ends at byte {offset}, expected at least {end}")
                offset = pwrite_all(dest_fd, memoryview(chunk), offset)
        finally:
            os.close(source)

    def list(self, prefix: str, *, recursive: bool = False) -> list[str]:
        directory = self._path(prefix.rstrip("/")) if prefix else self.root
        with self._errors(prefix, "list"):
            try:
                if recursive:
                    return [
                        os.path.relpath(os.path.join(d, n), directory).replace(os.sep, "/")
                        for d, _, names in os.walk(directory)
                        for n in names
                    ]
                with os.scandir(directory) as entries:
                    return [e.name + "/" if e.is_dir(follow_symlinks=False) else e.name for e in entries]
            except (FileNotFoundError, NotADirectoryError):
                return []

    def read_text(self, name: str) -> str | None:
        with self._errors(name, "read"):
            try:
                with open(self._path(name), encoding="utf-8") as f:
                    return f.read()
            except FileNotFoundError:
                return None

    def create_text(self, name: str, text: str) -> bool:
        return self._write_atomically(name, iter([text.encode()]), None, replace=False)

    def delete(self, name: str) -> None:
        path = self._path(name)
        with self._errors(name, "delete"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._prune(os.path.dirname(path))

    def _prune(self, directory: str) -> None:
        """Removes ``directory`` and its parents below the root while empty: like object storage,
        a prefix exists only while an object is below it."""
        while directory != self.root and directory.startswith(self.root.rstrip("/") + "/"):
            try:
                os.rmdir(directory)
            except OSError:  # not empty, or already gone
                return
            directory = os.path.dirname(directory)
