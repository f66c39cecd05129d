"""The object primitives a backup backend implements (``ObjectStore``), and the helpers backends share.

A backend is one module (``gcs_backup``, ``s3_backup``, ``file_backup``) with an ``ObjectStore``
subclass; it imports this module only. The backup logic over it is ``backup_store.BackupStore``,
and ``backup_backends.open_backup_store`` picks the backend from the URL scheme.
"""

import abc
import builtins
import concurrent.futures
import contextlib
import dataclasses
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from replicator.local_tier.incoming import pwrite_all

COPY_BYTES = 1 << 20  # one read of a response body into the destination file

T = TypeVar("T")


class BackupError(Exception):
    """The backup store is unreachable, refused a request, or holds missing or corrupt data."""


@dataclasses.dataclass(frozen=True)
class Upload:
    """One file to store; the stored object must have exactly the size and CRC32C the step's manifest recorded.

    Attributes:
      local_path: the file on this node.
      name: the object name, relative to the store's prefix.
      size: bytes, from the step's manifest.
      crc32c: 8 hex digits, from the step's manifest.
    """

    local_path: str
    name: str
    size: int
    crc32c: str


class ObjectStore(abc.ABC):
    """The object primitives a backend implements. Names are relative to the store's prefix, ``/``-separated.

    Every method raises ``BackupError`` when the store fails or refuses; local files are not the store,
    so a local ``OSError`` (unreadable source, full destination) propagates as ``OSError``.
    """

    url: str  # where the store is, for messages: gs://bucket/prefix, file:///path

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, *, endpoint: str | None = None) -> "ObjectStore":
        """The backend for ``url`` (``<scheme>://...``, the form its scheme takes); ``endpoint`` is
        where a compatible service or an emulator runs (``http://HOST:PORT``), or None for the default.

        Raises:
          ValueError: a malformed URL, or an endpoint the backend does not take.
          BackupError: no credentials.
        """

    @abc.abstractmethod
    def put_files(
        self, uploads: Sequence[Upload], workers: int, stored: Callable[[Upload], None] | None = None
    ) -> None:
        """Stores every upload, up to ``workers`` at a time, each checked end to end; tries them all.

        An object is kept only if the store holds exactly the bytes whose size and CRC32C the manifest
        recorded; an upload that does not match is removed (or never becomes visible). ``stored``, if
        given, is called (from a worker thread) with each upload once its bytes are sent.

        Raises:
          BackupError: one or more uploads failed or did not match (``uploads_failed``).
        """

    @abc.abstractmethod
    def download_range(self, name: str, start: int, length: int, dest_fd: int) -> None:
        """Writes bytes ``[start, start + length)`` of object ``name`` into ``dest_fd`` at the same offsets.

        Raises:
          BackupError: the object is missing or shorter than ``start + length`` bytes, or the read failed.
        """

    @abc.abstractmethod
    def list(self, prefix: str, *, recursive: bool = False) -> list[str]:
        """Names below ``prefix`` (which ends with ``/``), relative to it.

        Returns:
          With ``recursive``, every object below ``prefix``. Otherwise the direct children: objects,
          and ``"<child>/"`` for each child prefix. Empty when nothing is there.
        """

    @abc.abstractmethod
    def read_text(self, name: str) -> str | None:
        """The UTF-8 content of a small object, or None when it does not exist."""

    @abc.abstractmethod
    def create_text(self, name: str, text: str) -> bool:
        """Creates a small object unless one exists under ``name`` (write-once); readers see all of it or none.

        Returns:
          True if this call created it, False if an object was there already (it is left unchanged).
        """

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Deletes an object; a missing object is not an error."""

    def partial_uploads(self, prefix: str) -> builtins.list[str]:  # builtins: the method list shadows the type here
        """Names below ``prefix`` (relative to it) of uploads started but neither completed nor aborted,
        such as an S3 multipart upload of an agent killed mid-upload. None by default: a backend whose
        interrupted writes are ordinary objects (``file://``) or invisible and self-expiring (GCS
        resumable sessions) has nothing to list."""
        return []

    def abort_partial_uploads(self, prefix: str) -> None:  # noqa: B027  # a hook: nothing to abort by default
        """Aborts every upload ``partial_uploads(prefix)`` lists (frees what the store holds for them)."""


def run_parallel(fn: Callable[[T], None], items: Iterable[T], workers: int) -> None:
    """Calls ``fn`` on every item, ``workers`` threads at a time; stops at the first failure.

    Raises:
      The first exception ``fn`` raised, after work not yet started is cancelled and running calls end.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, item) for item in items]
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = next((error for f in futures if f in done and (error := f.exception()) is not None), None)
        if failed is not None:
            for future in futures:
                future.cancel()
            raise failed


@contextlib.contextmanager
def store_errors(url: str, name: str, what: str, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Turns any of ``errors`` (a backend's failures) into ``BackupError("<url>/<name>: <what>: ...")``."""
    try:
        yield
    except errors as exc:
        raise BackupError(f"{url}/{name}: {what}: {exc}") from exc


def bucket_and_prefix(url: str, scheme: str) -> tuple[str, str]:
    """``<scheme>://BUCKET[/PREFIX]`` -> (bucket, ``""`` or ``"PREFIX/"``).

    Raises:
      ValueError: another scheme, no bucket, or a query or fragment.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != scheme or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"{url!r} is not {scheme}://BUCKET[/PREFIX]")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def copy_body(where: str, readinto: Callable[[memoryview], int], start: int, length: int, dest_fd: int) -> None:
    """Copies ``length`` bytes of a response body (its ``readinto``) to ``dest_fd`` at offset ``start``,
    1 MiB at a time, straight into the destination file.

    Raises:
      BackupError: the body ends early (``where`` names the object).
    """
    view = memoryview(bytearray(min(COPY_BYTES, length)))
    offset, end = start, start + length
    while offset < end:
        received = readinto(view[: min(len(view), end - offset)])
        if not received:
            raise BackupError(f"{where}: object ends at byte {offset}, expected at least {end}")
        offset = pwrite_all(dest_fd, view[:received], offset)


def uploads_failed(url: str, failures: Sequence[str], total: int) -> BackupError:
    """The error for ``failures`` (one line per failed upload) among ``total`` uploads to ``url``."""
    shown = "; ".join(failures[:5]) + (f"; +{len(failures) - 5} more" if len(failures) > 5 else "")
    return BackupError(f"{len(failures)} of {total} uploads to {url} failed: {shown}")
