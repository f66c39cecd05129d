"""The ``s3://`` backend: AWS S3 or an S3-compatible store (MinIO, Ceph RGW, CoreWeave, R2), through boto3.

Credentials and region come from boto3's standard chain (environment, shared config and credentials
files, IRSA / web identity, instance profile). The endpoint is ``--s3-endpoint-url``, else
``AWS_ENDPOINT_URL`` (read by boto3 itself), else AWS. Uploads go through s3transfer's
``TransferManager`` (multipart above ``PART_BYTES``); restores are ranged ``GetObject`` calls.

Integrity. On first use the store is probed once (a small object below the prefix, then deleted)
and the mode is logged:

- ``crc32c`` (AWS, MinIO, ...): every object declares the CRC32C the step's manifest recorded, so the
  store refuses other bytes. A file below ``PART_BYTES`` is one ``PutObject`` with
  ``x-amz-checksum-crc32c``. A larger one is a multipart upload of checksum type ``FULL_OBJECT``:
  each part carries its own CRC32C (computed by botocore through awscrt) and
  ``CompleteMultipartUpload`` carries the manifest's whole-file CRC32C, which the store checks
  against the parts combined. The default ``COMPOSITE`` type (a CRC of the parts' CRCs, ``...-N``)
  could not be compared with the manifest. The stored checksum is read back (``HeadObject``) too.
  Measured against MinIO on 2 loaded cores, 1 GiB in 8 files: 21 s as multipart ``FULL_OBJECT``,
  17 s as one ``PutObject`` per file (no client-side CRC32C of the parts). Multipart stays: a
  ``PutObject`` stops at 5 GiB, and parts upload a large file in parallel where the network, not
  the CPU, is the limit.
- ``md5``, for a store that ignores or rejects ``x-amz-checksum-*``: one pass over the local file
  checks its CRC32C against the manifest and records the MD5 of each part as s3transfer will cut
  them; every ``PutObject`` / ``UploadPart`` carries ``Content-MD5`` (the store refuses bytes damaged
  in transit); the stored ETag (the MD5, or the MD5 of the part MD5s plus ``-N``) must equal the one
  computed from the checked bytes, so a file changed between the two reads is caught. A store whose
  ETag is not the MD5 fails every upload in this mode, loudly.

Write-once. ``create_text`` (``COMMIT`` and rank manifests) sends ``If-None-Match: *`` when the probe
found the store honours it; otherwise it checks with ``HeadObject`` and then writes. In that mode two
writers racing between the check and the write both succeed and the later one wins; for ``COMMIT``
both write the same bytes, and a rank's manifest has one writer per incarnation (its own node).

Interrupted multipart uploads (an agent killed mid-upload) are listed and aborted by retention
(``BackupStore.retain``), not left to a bucket lifecycle rule.
"""

import base64
import builtins
import contextlib
import dataclasses
import hashlib
import http.client
import logging
import threading
import uuid
from collections.abc import Callable, Sequence

import boto3
import botocore.config
import botocore.exceptions
import google_crc32c
import urllib3
from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber
from s3transfer.utils import ChunksizeAdjuster

from replicator.backup_tier.object_store import (
    BackupError,
    ObjectStore,
    Upload,
    bucket_and_prefix,
    copy_body,
    run_parallel,
    store_errors,
    uploads_failed,
)

log = logging.getLogger(__name__)

PART_BYTES = 8 << 20  # multipart threshold and part size (s3transfer's defaults; S3's minimum part is 5 MiB)
_READ_BYTES = 1 << 20
_POOL_CONNECTIONS = 64
# botocore's "standard" retries (exponential backoff with jitter, 5xx, throttling, connection errors):
# 3 attempts of at most 5 s to connect give up within ~20 s, so an outage is reported, and the node
# agent's own backoff retries the whole upload.
_CLIENT_CONFIG = dict(
    connect_timeout=5,
    read_timeout=60,
    retries={"mode": "standard", "max_attempts": 3},
    max_pool_connections=_POOL_CONNECTIONS,
    # Checksums are ours to declare (the manifest's), not botocore's default CRC32.
    request_checksum_calculation="when_required",
    response_checksum_validation="when_required",
)

# What a failing or refusing store raises through boto3 and s3transfer.
_STORE_ERRORS = (
    botocore.exceptions.BotoCoreError,
    botocore.exceptions.ClientError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
)


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _crc32c_b64(crc32c_hex: str) -> str:
    """8 hex digits -> the base64 of the 4 big-endian bytes, as ``x-amz-checksum-crc32c`` carries it."""
    return _b64(bytes.fromhex(crc32c_hex))


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _add_content_md5(params: dict, **_) -> None:
    """botocore ``before-call`` hook: a ``Content-MD5`` header of the request body (md5 mode)."""
    body = params.get("body")
    if body is None or "Content-MD5" in params["headers"]:
        return
    if isinstance(body, (bytes, bytearray)):
        digest = hashlib.md5(body, usedforsecurity=False).digest()
    else:
        start, md5 = body.tell(), hashlib.md5(usedforsecurity=False)
        for chunk in iter(lambda: body.read(_READ_BYTES), b""):
            md5.update(chunk)
        body.seek(start)
        digest = md5.digest()
    params["headers"]["Content-MD5"] = _b64(digest)


class _Sent(BaseSubscriber):
    """Tells ``stored`` of an upload once s3transfer has sent all of it (not when it failed)."""

    def __init__(self, upload: Upload, stored: Callable[[Upload], None]):
        self._upload, self._stored = upload, stored

    def on_done(self, future, **kwargs) -> None:
        try:
            future.result()  # done: returns or raises at once
        except Exception:  # the failure is collected with the others in put_files
            return
        self._stored(self._upload)


@dataclasses.dataclass(frozen=True)
class S3Features:
    """What the store was found to support.

    Attributes:
      crc32c: it checks ``x-amz-checksum-crc32c`` (refusing other bytes) and keeps the value.
      conditional_writes: it refuses ``PutObject`` with ``If-None-Match: *`` when the key exists.
    """

    crc32c: bool
    conditional_writes: bool


class S3Objects(ObjectStore):
    """Objects in one bucket below a prefix.

    Args:
      bucket: the bucket name.
      prefix: ``""`` or a ``/``-terminated prefix inside the bucket.
      endpoint_url: an S3-compatible endpoint, e.g. ``http://127.0.0.1:9000``; None for
        ``AWS_ENDPOINT_URL`` or AWS.
      features: pin the integrity and write-once modes instead of probing the store (tests; a store
        whose answers to the probe you distrust).

    Raises:
      BackupError: boto3 finds no credentials.
    """

    def __init__(
        self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, features: S3Features | None = None
    ):
        session = boto3.session.Session()
        if session.get_credentials() is None:
            raise BackupError(
                f"s3://{bucket}: boto3 found no credentials (environment, shared config, "
                "web identity or instance profile)"
            )
        self._client = session.client("s3", endpoint_url=endpoint_url, config=botocore.config.Config(**_CLIENT_CONFIG))
        self._bucket = bucket
        self._prefix = prefix
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        self._features: S3Features | None = None
        self._features_lock = threading.Lock()
        if features is not None:
            self._use(features, "pinned")

    @classmethod
    def from_url(cls, url: str, *, endpoint: str | None = None) -> "S3Objects":
        """``s3://BUCKET[/PREFIX]`` -> S3Objects; ``endpoint`` is an S3-compatible endpoint
        (``http://127.0.0.1:9000``), or None for ``AWS_ENDPOINT_URL``, else AWS.

        Raises:
          ValueError: no bucket, or a query or fragment.
          BackupError: no credentials.
        """
        return cls(*bucket_and_prefix(url, "s3"), endpoint_url=endpoint)

    def _errors(self, name: str, what: str) -> contextlib.AbstractContextManager[None]:
        return store_errors(self.url, name, what, _STORE_ERRORS)

    def features(self) -> S3Features:
        """The store's features: probed on first use (then cached), or pinned.

        Raises:
          BackupError: the store failed during the probe (it is probed again next time).
        """
        with self._features_lock:
            features = self._features
            if features is None:
                features = self._probe()
                self._use(features, "probed")  # keeps it
            return features

    def _use(self, features: S3Features, how: str) -> None:
        """Adopts ``features`` (``how``: probed or pinned) and logs the modes they imply."""
        self._features = features
        if not features.crc32c:
            self._client.meta.events.register("before-call.s3.PutObject", _add_content_md5)
            self._client.meta.events.register("before-call.s3.UploadPart", _add_content_md5)
        integrity = (
            "crc32c: the store refuses bytes whose CRC32C differs from the manifest's"
            if features.crc32c
            else "md5: the store lacks CRC32C checksums; Content-MD5 per request, ETags checked against the manifest's bytes"
        )
        writes = "If-None-Match: *" if features.conditional_writes else "check-then-write (no conditional writes)"
        (log.info if features.crc32c and features.conditional_writes else log.warning)(
            "%s (%s): integrity mode %s; COMMIT and manifests: %s", self.url, how, integrity, writes
        )

    def _probe(self) -> S3Features:
        name = f".mtc-probe-{uuid.uuid4().hex}"
        key = self._prefix + name
        data = b"mtc probe"
        right = _b64(google_crc32c.Checksum(data).digest())
        put = dict(Bucket=self._bucket, Key=key, Body=data)
        with self._errors(name, "probe"):  # errors name the object below self.url, as the others do
            try:
                try:
                    self._client.put_object(**put, ChecksumCRC32C=_b64(google_crc32c.Checksum(b"other").digest()))
                    crc32c = False  # it kept bytes that do not match the declared CRC32C
                except botocore.exceptions.ClientError as exc:
                    if _status(exc) >= 500:
                        raise
                    try:
                        self._client.put_object(**put, ChecksumCRC32C=right)
                        head = self._client.head_object(Bucket=self._bucket, Key=key, ChecksumMode="ENABLED")
                        crc32c = head.get("ChecksumCRC32C") == right
                    except botocore.exceptions.ClientError as rejected:
                        if _status(rejected) >= 500:
                            raise
                        crc32c = False  # it rejects the header itself
                if not crc32c:
                    self._client.put_object(**put)
                try:
                    self._client.put_object(**put, IfNoneMatch="*")
                    conditional = False  # it overwrote an existing key
                except botocore.exceptions.ClientError as exc:
                    if _status(exc) >= 500 and _status(exc) != 501:
                        raise
                    conditional = _status(exc) == 412
            finally:
                with contextlib.suppress(*_STORE_ERRORS):
                    self._client.delete_object(Bucket=self._bucket, Key=key)
        return S3Features(crc32c, conditional)

    def put_files(
        self, uploads: Sequence[Upload], workers: int, stored: Callable[[Upload], None] | None = None
    ) -> None:
        features = self.features()
        failures: list[str] = []
        etags: dict[str, str] = {}
        if not features.crc32c:

            def check(upload: Upload) -> None:
                try:
                    etags[upload.name] = _checked_etag(upload)
                except BackupError as exc:
                    failures.append(f"{upload.name}: {exc}")

            run_parallel(check, uploads, workers)
        sending = [u for u in uploads if features.crc32c or u.name in etags]
        config = TransferConfig(
            multipart_threshold=PART_BYTES,
            multipart_chunksize=PART_BYTES,
            max_request_concurrency=workers,
            io_chunksize=_READ_BYTES,
        )
        with TransferManager(self._client, config) as manager:
            futures = [
                manager.upload(
                    u.local_path,
                    self._bucket,
                    self._prefix + u.name,
                    extra_args={"ChecksumCRC32C": _crc32c_b64(u.crc32c)} if features.crc32c else {},
                    subscribers=[] if stored is None else [_Sent(u, stored)],
                )
                for u in sending
            ]
        for upload, future in zip(sending, futures):
            try:
                future.result()
                self._check_stored(upload, features, etags.get(upload.name))
            except (*_STORE_ERRORS, BackupError) as exc:  # refused, failed, or stored other bytes
                failures.append(f"{upload.name}: {exc}")
        if failures:
            raise uploads_failed(self.url, sorted(failures), len(uploads))

    def _check_stored(self, upload: Upload, features: S3Features, etag: str | None) -> None:
        """Compares the stored object with the manifest (crc32c mode) or the checked bytes' ETag (md5
        mode); deletes it and raises ``BackupError`` when they differ."""
        key = self._prefix + upload.name
        head = self._client.head_object(Bucket=self._bucket, Key=key, ChecksumMode="ENABLED")
        stored: tuple[int, str | None]
        expected: tuple[int, str | None]
        if features.crc32c:
            stored, expected = (
                (head["ContentLength"], head.get("ChecksumCRC32C")),
                (upload.size, _crc32c_b64(upload.crc32c)),
            )
        else:
            stored, expected = (head["ContentLength"], head["ETag"].strip('"')), (upload.size, etag)
        if stored != expected:
            with self._errors(upload.name, "delete mismatching object"):
                self._client.delete_object(Bucket=self._bucket, Key=key)
            raise BackupError(
                f"stored {stored[0]} bytes with checksum {stored[1]}, expected {expected[0]} bytes with {expected[1]}"
            )

    def download_range(self, name: str, start: int, length: int, dest_fd: int) -> None:
        with self._errors(name, "read"):
            try:
                response = self._client.get_object(
                    Bucket=self._bucket, Key=self._prefix + name, Range=f"bytes={start}-{start + length - 1}"
                )
            except botocore.exceptions.ClientError as exc:
                if _status(exc) == 404:
                    raise BackupError(f"{self.url}/{name}: no such object") from exc
                if _status(exc) == 416:
                    raise BackupError(f"{self.url}/{name}: object is shorter than {start + 1} bytes") from exc
                raise
            with contextlib.closing(response["Body"]) as body:
                copy_body(f"{self.url}/{name}", body.readinto, start, length, dest_fd)

    def list(self, prefix: str, *, recursive: bool = False) -> list[str]:
        full = self._prefix + prefix
        names: list[str] = []
        with self._errors(prefix, "list"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket, Prefix=full, **({} if recursive else {"Delimiter": "/"})
            )
            for page in pages:
                names += [o["Key"][len(full) :] for o in page.get("Contents", [])]
                names += [p["Prefix"][len(full) :] for p in page.get("CommonPrefixes", [])]
        return names

    def read_text(self, name: str) -> str | None:
        with self._errors(name, "read"):
            try:
                response = self._client.get_object(Bucket=self._bucket, Key=self._prefix + name)
            except botocore.exceptions.ClientError as exc:
                if _status(exc) == 404:
                    return None
                raise
            with contextlib.closing(response["Body"]) as body:
                return body.read().decode()

    def create_text(self, name: str, text: str) -> bool:
        features = self.features()
        data = text.encode()
        put = dict(Bucket=self._bucket, Key=self._prefix + name, Body=data, ContentType="text/plain; charset=utf-8")
        if features.crc32c:
            put["ChecksumCRC32C"] = _b64(google_crc32c.Checksum(data).digest())
        with self._errors(name, "create"):
            if features.conditional_writes:
                try:
                    self._client.put_object(**put, IfNoneMatch="*")
                    return True
                except botocore.exceptions.ClientError as exc:
                    if _status(exc) == 412:
                        return False
                    raise
            # Check-then-write: see the module docstring for the race this leaves.
            try:
                self._client.head_object(Bucket=self._bucket, Key=put["Key"])
                return False
            except botocore.exceptions.ClientError as exc:
                if _status(exc) != 404:
                    raise
            self._client.put_object(**put)
            return True

    def delete(self, name: str) -> None:
        with self._errors(name, "delete"):
            self._client.delete_object(Bucket=self._bucket, Key=self._prefix + name)  # S3 deletes are idempotent

    def _multipart_uploads(self, prefix: str) -> builtins.list[dict]:  # builtins: the method list shadows the type here
        """In-progress multipart uploads below ``prefix``. The bucket's are listed and filtered here:
        MinIO lists them only for an exact key or a whole bucket (measured; AWS takes any prefix),
        and a bucket holds few in-progress uploads."""
        full = self._prefix + prefix
        pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self._bucket)
        return [u for page in pages for u in page.get("Uploads", []) if u["Key"].startswith(full)]

    def partial_uploads(self, prefix: str) -> builtins.list[str]:
        with self._errors(prefix, "list multipart uploads"):
            return [u["Key"][len(self._prefix + prefix) :] for u in self._multipart_uploads(prefix)]

    def abort_partial_uploads(self, prefix: str) -> None:
        with self._errors(prefix, "abort multipart uploads"):
            for upload in self._multipart_uploads(prefix):
                try:
                    self._client.abort_multipart_upload(
                        Bucket=self._bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                except botocore.exceptions.ClientError as exc:
                    if _status(exc) != 404:  # finished or aborted meanwhile
                        raise


def _checked_etag(upload: Upload) -> str:
    """One pass over the local file: checks its size and CRC32C against the manifest and returns the
    ETag S3 gives the same bytes uploaded by s3transfer with ``PART_BYTES`` (md5 mode).

    Raises:
      BackupError: the file does not match the manifest (nothing is uploaded).
      OSError: the file cannot be read.
    """
    part_bytes = ChunksizeAdjuster().adjust_chunksize(PART_BYTES, upload.size)
    crc, size, whole, parts = google_crc32c.Checksum(), 0, hashlib.md5(usedforsecurity=False), []
    with open(upload.local_path, "rb") as source:
        for part in iter(lambda: source.read(part_bytes), b""):
            crc.update(part)
            whole.update(part)
            parts.append(hashlib.md5(part, usedforsecurity=False).digest())
            size += len(part)
    if (size, crc.hexdigest().decode()) != (upload.size, upload.crc32c):
        raise BackupError(
            f"local file has {size} bytes with crc32c {crc.hexdigest().decode()}, "
            f"manifest says {upload.size} bytes with {upload.crc32c}"
        )
    if size < PART_BYTES:  # s3transfer sends one PutObject below its multipart threshold
        return whole.hexdigest()
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"
