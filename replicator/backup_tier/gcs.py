"""The ``gs://`` backend: Google Cloud Storage with Application Default Credentials (or an emulator).

Uploads run on a thread pool, one ``upload_from_filename`` per file. Each blob declares the CRC32C from the
step's manifest in its metadata, so GCS refuses bytes that do not match what was checksummed when the
step committed (end to end: a file changed since, or damaged in transit, is never stored); the
stored object's ``crc32c`` is compared once more after the upload.

Downloads are ranged GETs of the JSON API media endpoint on an ``AuthorizedSession`` with the same
credentials, read 1 MiB at a time straight into the destination file, retried with the library's
``DEFAULT_RETRY``. ``create_text`` is write-once with ``if_generation_match=0``. The library's own download path iterates 8 KiB at a time: measured on a 2-core
machine against fake-gcs-server, one ``download_to_filename`` stream ran at ~560 MiB/s and 4-16 threads
of ranged ``download_to_file(start=, end=)`` at 0.45-0.86x of that single stream (bound by the GIL),
so they could not make a parallel restore faster than a serial one.
"""

import base64
import concurrent.futures
import contextlib
import http.client
import urllib.parse
from collections.abc import Callable, Sequence

import google.auth
import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage import exceptions as storage_exceptions
from google.cloud.storage.retry import DEFAULT_RETRY

from replicator.backup_tier.object_store import (
    BackupError,
    ObjectStore,
    Upload,
    bucket_and_prefix,
    copy_body,
    store_errors,
    uploads_failed,
)

GCS_ENDPOINT = "https://storage.googleapis.com"
_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_TIMEOUT_SECONDS = (30.0, 120.0)  # connect, read
# The library retries transient errors for up to 120 s per call; a node agent would rather report
# an outage sooner and retry the whole upload with its own backoff.
_RETRY = DEFAULT_RETRY.with_timeout(20.0)
_POOL_CONNECTIONS = 64  # kept-alive connections for ranged reads; more workers than this still work

# What a failing or refusing store raises through the client library or the session.
_STORE_ERRORS = (
    api_exceptions.GoogleAPIError,
    auth_exceptions.GoogleAuthError,
    storage_exceptions.InvalidResponse,
    storage_exceptions.DataCorruption,
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
)


def _crc32c_b64(crc32c_hex: str) -> str:
    """8 hex digits -> the base64 of the 4 big-endian bytes, as GCS writes ``crc32c``."""
    return base64.b64encode(bytes.fromhex(crc32c_hex)).decode()


class GcsObjects(ObjectStore):
    """Objects in one bucket below a prefix.

    Args:
      bucket: the bucket name.
      prefix: ``""`` or a ``/``-terminated prefix inside the bucket.
      emulator_host: e.g. ``http://127.0.0.1:4443`` for fake-gcs-server (anonymous, project ``test``);
        None for GCS with Application Default Credentials.

    Raises:
      BackupError: no Application Default Credentials.
    """

    def __init__(self, bucket: str, prefix: str = "", *, emulator_host: str | None = None):
        credentials: Credentials
        project: str | None
        if emulator_host:
            credentials, project, self._endpoint = AnonymousCredentials(), "test", emulator_host.rstrip("/")
            client = storage.Client(
                project=project, credentials=credentials, client_options={"api_endpoint": self._endpoint}
            )
        else:
            try:
                credentials, project = google.auth.default(scopes=_SCOPES)
            except auth_exceptions.DefaultCredentialsError as exc:
                raise BackupError(f"gs://{bucket}: no Application Default Credentials: {exc}") from exc
            self._endpoint = GCS_ENDPOINT
            client = storage.Client(project=project, credentials=credentials)
        self._bucket = client.bucket(bucket)
        self._prefix = prefix
        self.url = f"gs://{bucket}/{prefix}".rstrip("/")
        self._session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=_POOL_CONNECTIONS)
        self._session.mount("https://", adapter)
        self._session.mount("http://", adapter)

    @classmethod
    def from_url(cls, url: str, *, endpoint: str | None = None) -> "GcsObjects":
        """``gs://BUCKET[/PREFIX]`` -> GcsObjects; ``endpoint`` is a GCS emulator
        (``http://127.0.0.1:4443``: anonymous credentials, project ``test``), or None for GCS.

        Raises:
          ValueError: no bucket, or a query or fragment.
          BackupError: no Application Default Credentials.
        """
        return cls(*bucket_and_prefix(url, "gs"), emulator_host=endpoint)

    def _errors(self, name: str, what: str) -> contextlib.AbstractContextManager[None]:
        return store_errors(self.url, name, what, _STORE_ERRORS)

    def put_files(
        self, uploads: Sequence[Upload], workers: int, stored: Callable[[Upload], None] | None = None
    ) -> None:
        pairs = []
        for upload in uploads:
            blob = self._bucket.blob(self._prefix + upload.name)
            blob.crc32c = _crc32c_b64(upload.crc32c)  # declared: GCS refuses other bytes
            pairs.append((upload.local_path, blob))

        def put(upload: Upload, blob: storage.Blob) -> None:
            # checksum=None: with the library's own checksum a small (multipart) upload would declare
            # the CRC32C of the bytes it read instead of the manifest's.
            blob.upload_from_filename(upload.local_path, checksum=None, retry=_RETRY, timeout=_TIMEOUT_SECONDS)
            if stored is not None:
                stored(upload)

        # Our own pool, not transfer_manager.upload_many: that reports nothing until every file is done.
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(put, upload, blob) for upload, (_, blob) in zip(uploads, pairs)]
        results = [future.exception() for future in futures]
        failures = []
        for upload, (_, blob), result in zip(uploads, pairs, results):
            if isinstance(result, _STORE_ERRORS):
                failures.append(f"{upload.name}: {result}")
            elif isinstance(result, BaseException):
                raise result  # reading the local file failed
            elif (blob.size, blob.crc32c) != (upload.size, _crc32c_b64(upload.crc32c)):
                failures.append(
                    f"{upload.name}: stored {blob.size} bytes with crc32c {blob.crc32c}, manifest says "
                    f"{upload.size} bytes with {_crc32c_b64(upload.crc32c)}"
                )
                with self._errors(upload.name, "delete mismatching object"):
                    blob.delete(if_generation_match=blob.generation)
        if failures:
            raise uploads_failed(self.url, failures, len(uploads))

    def download_range(self, name: str, start: int, length: int, dest_fd: int) -> None:
        full = self._prefix + name
        url = (
            f"{self._endpoint}/download/storage/v1/b/{urllib.parse.quote(self._bucket.name, safe='')}"
            f"/o/{urllib.parse.quote(full, safe='')}?alt=media"
        )
        headers = {"Range": f"bytes={start}-{start + length - 1}", "Accept-Encoding": "identity"}

        def attempt() -> None:
            with self._session.get(url, headers=headers, stream=True, timeout=_TIMEOUT_SECONDS) as response:
                if response.status_code == 404:
                    raise BackupError(f"{self.url}/{name}: no such object")
                if response.status_code == 416:
                    raise BackupError(f"{self.url}/{name}: object is shorter than {start + 1} bytes")
                if response.status_code >= 400:
                    raise api_exceptions.from_http_response(response)  # 429 and 5xx are retried
                if not (response.status_code == 206 or (response.status_code == 200 and start == 0)):
                    raise BackupError(f"{self.url}/{name}: HTTP {response.status_code} to a ranged read")
                copy_body(f"{self.url}/{name}", response.raw.readinto, start, length, dest_fd)

        with self._errors(name, "read"):
            _RETRY(attempt)()

    def list(self, prefix: str, *, recursive: bool = False) -> list[str]:
        full = self._prefix + prefix
        with self._errors(prefix, "list"):
            blobs = self._bucket.list_blobs(
                prefix=full, delimiter=None if recursive else "/", retry=_RETRY, timeout=_TIMEOUT_SECONDS
            )
            names = [blob.name[len(full) :] for blob in blobs]
            return names + [p[len(full) :] for p in sorted(blobs.prefixes)]

    def read_text(self, name: str) -> str | None:
        with self._errors(name, "read"):
            try:
                return self._bucket.blob(self._prefix + name).download_as_text(retry=_RETRY, timeout=_TIMEOUT_SECONDS)
            except api_exceptions.NotFound:
                return None

    def create_text(self, name: str, text: str) -> bool:
        with self._errors(name, "create"):
            try:
                self._bucket.blob(self._prefix + name).upload_from_string(
                    text.encode(),
                    content_type="text/plain; charset=utf-8",
                    checksum="crc32c",
                    retry=_RETRY,
                    timeout=_TIMEOUT_SECONDS,
                    if_generation_match=0,
                )
                return True
            except api_exceptions.PreconditionFailed:
                return False

    def delete(self, name: str) -> None:
        with self._errors(name, "delete"):
            try:
                self._bucket.blob(self._prefix + name).delete(retry=_RETRY, timeout=_TIMEOUT_SECONDS)
            except api_exceptions.NotFound:
                pass
