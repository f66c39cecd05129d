"""The backup tier from its URL: ``open_backup_store`` picks the backend by the URL's scheme.

Adding a backend is one module with an ``object_store.ObjectStore`` subclass (its ``from_url``
builds it from the URL) and one line in ``_BACKENDS``.
"""

import importlib

from replicator.backup_tier.store import DEFAULT_WORKERS, BackupStore

# URL scheme -> (module, ObjectStore subclass). A backend is imported when first opened: an agent
# without a gs:// or s3:// backup never loads google-cloud-storage or boto3 (0.2-0.3 s of CPU and
# 20-35 MB each, measured at import).
_BACKENDS = {
    "gs": ("replicator.backup_tier.gcs", "GcsObjects"),
    "s3": ("replicator.backup_tier.s3", "S3Objects"),
    "file": ("replicator.backup_tier.filesystem", "FileObjects"),
}


def open_backup_store(
    url: str, *, emulator_host: str | None = None, s3_endpoint_url: str | None = None, workers: int = DEFAULT_WORKERS
) -> BackupStore:
    """Opens the backup store at ``url``: credentials are looked up now, objects only when used.

    Args:
      url: ``gs://BUCKET[/PREFIX]`` (Application Default Credentials), ``s3://BUCKET[/PREFIX]``
        (boto3's credential chain and region) or ``file:///PATH``.
      emulator_host: for ``gs://`` only, a GCS emulator such as ``http://127.0.0.1:4443``; anonymous
        credentials, project ``test``.
      s3_endpoint_url: for ``s3://`` only, an S3-compatible endpoint such as ``http://127.0.0.1:9000``
        (default: ``AWS_ENDPOINT_URL``, else AWS).
      workers: concurrent transfers for uploads and deletions.

    Raises:
      ValueError: an unsupported scheme or a malformed URL, or an endpoint option for another scheme.
      BackupError: no credentials (``gs://`` without an emulator, or ``s3://``).
    """
    scheme = url.partition("://")[0]
    if emulator_host is not None and scheme != "gs":
        raise ValueError(f"emulator_host applies to gs:// only, not {url!r}")
    if s3_endpoint_url is not None and scheme != "s3":
        raise ValueError(f"an S3 endpoint URL applies to s3:// only, not {url!r}")
    if scheme not in _BACKENDS:
        raise ValueError(
            f"unsupported backup URL {url!r}: expected gs://BUCKET[/PREFIX], s3://BUCKET[/PREFIX] or file:///PATH"
        )
    module, name = _BACKENDS[scheme]
    backend = getattr(importlib.import_module(module), name)
    return BackupStore(backend.from_url(url, endpoint=emulator_host or s3_endpoint_url), workers=workers)
