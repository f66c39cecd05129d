"""Is the backup store usable? A write, read, list and delete under a probe prefix, as an agent checks at its start.

The probe takes the paths a backup takes: ``ObjectStore.put_files`` (an upload checked end to end against its
size and CRC32C), ``create_text`` (write-once, as ``COMMIT`` and rank manifests are written), ``read_text``,
``list``, ``partial_uploads`` (what retention lists to abort interrupted S3 multipart uploads) and ``delete``. Its
objects live below ``.mtc-probe/<node>-<random>/``: a job's objects live below ``<namespace>/``, a DNS-1123 label,
which never starts with a dot, so a probe never meets a job's data. It does not start a multipart upload: S3's
needs a backend call of its own (and 5 MiB parts but the last), and GCS and ``file://`` have none.
"""

import contextlib
import dataclasses
import tempfile
import time
import uuid
from collections.abc import Iterator

import google_crc32c

from replicator.backup_tier.object_store import BackupError, ObjectStore, Upload

PROBE_PREFIX = ".mtc-probe/"
_PAYLOAD = b"mtc backup store probe\n"


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What a probe found.

    Attributes:
      url: the store probed (``gs://...``, ``s3://...``, ``file://...``).
      error: None when every operation worked; else one line naming the operation that failed and the store's
        answer.
      seconds: how long the probe took.
    """

    url: str
    error: str | None
    seconds: float

    @property
    def usable(self) -> bool:
        return self.error is None


def probe_store(objects: ObjectStore, node_id: str) -> ProbeResult:
    """Writes, reads back, lists and deletes two small objects below ``.mtc-probe/<node_id>-<random>/``.

    Args:
      objects: the store (``BackupStore.objects``).
      node_id: names the probe's prefix, so an operator can tell whose probe a leftover object is.

    Returns:
      The result; a failure is never raised (the caller decides what an unusable store means).
    """
    started = time.monotonic()
    prefix = f"{PROBE_PREFIX}{node_id}-{uuid.uuid4().hex[:8]}/"
    try:
        _probe(objects, prefix)
        error = None
    except BackupError as exc:
        error = " ".join(str(exc).split())  # one line: a backend's message may hold newlines
    return ProbeResult(objects.url, error, time.monotonic() - started)


@contextlib.contextmanager
def _doing(what: str) -> Iterator[None]:
    """Names the operation in a failure: ``"<what> failed: <the store's answer>"``."""
    try:
        yield
    except (BackupError, OSError, ValueError) as exc:
        raise BackupError(f"{what} failed: {exc}") from exc


def _probe(objects: ObjectStore, prefix: str) -> None:
    """Raises ``BackupError`` naming the first operation that failed; removes what it wrote either way."""
    names = [prefix + "upload", prefix + "create"]
    try:
        with _doing("upload"), tempfile.NamedTemporaryFile(prefix="mtc-probe-") as local:
            local.write(_PAYLOAD)
            local.flush()
            crc = f"{google_crc32c.value(_PAYLOAD):08x}"
            objects.put_files([Upload(local.name, names[0], len(_PAYLOAD), crc)], workers=1)
        with _doing("write-once create"):
            if not objects.create_text(names[1], _PAYLOAD.decode()):
                raise BackupError(f"{objects.url}/{names[1]}: a fresh name exists already")
        with _doing("read"):
            if objects.read_text(names[1]) != _PAYLOAD.decode():
                raise BackupError(f"{objects.url}/{names[1]}: other bytes than written")
        with _doing("list"):
            listed = sorted(objects.list(prefix))
            if listed != ["create", "upload"]:
                raise BackupError(f"{objects.url}/{prefix}: {listed}, expected ['create', 'upload']")
            objects.partial_uploads(prefix)
        with _doing("delete"):
            for name in names:
                objects.delete(name)
            if objects.list(prefix):
                raise BackupError(f"{objects.url}/{prefix}: objects remain after delete")
    except BaseException:
        with contextlib.suppress(BackupError, OSError):  # best effort: the first failure is the one to report
            for name in names:
                objects.delete(name)
        raise
