"""The chaos suite's backup store, read and damaged from outside the agents: a ``file://`` directory, or
fake-gcs-server behind ``store_proxy.UnavailableProxy`` (``gs://``), whose outage answers 503.

Both give the job's backup entries (``steps/<step>[-t<t>]``, ``replicator/backup_tier/layout.py``) with the
time their ``COMMIT`` was written, read an object, and flip a byte of one. The oracle reads the emulator directly,
never through the proxy, so an outage hides nothing from it.
"""

import contextlib
import os
import posixpath
import time
from collections.abc import Iterator

from tests.helpers.servers import FakeGcsServer
from tests.helpers.steps import flip_byte
from tests.helpers.store_proxy import UnavailableProxy

NAMESPACE = "default"


class FileStore:
    """A ``file://`` store in ``root``; its outage is the directory moved away and a file put in its place (so
    nothing can recreate it)."""

    kind = "file"

    def __init__(self, root: str):
        self.root = root
        self.url, self.env = f"file://{root}", {}

    def _steps(self, job: str) -> str:
        return os.path.join(self.root, NAMESPACE, job, "steps")

    def commits(self, job: str) -> dict[str, float]:
        """Entry (``<step>[-t<t>]``) -> when its ``COMMIT`` was written (unix seconds), for every committed entry."""
        steps, found = self._steps(job), {}
        for entry in os.listdir(steps) if os.path.isdir(steps) else []:
            with contextlib.suppress(FileNotFoundError):
                found[entry] = os.path.getmtime(os.path.join(steps, entry, "COMMIT"))
        return found

    def read(self, job: str, path: str) -> bytes:
        """The object ``path`` (below the job's ``steps/``)."""
        with open(os.path.join(self._steps(job), *path.split("/")), "rb") as f:
            return f.read()

    def exists(self, job: str, path: str) -> bool:
        return os.path.exists(os.path.join(self._steps(job), *path.split("/")))

    def flip(self, job: str, path: str) -> None:
        flip_byte(os.path.join(self._steps(job), *path.split("/")))

    @contextlib.contextmanager
    def gone(self) -> Iterator[None]:
        away = self.root + ".away"
        os.rename(self.root, away)
        try:
            with open(self.root, "x", encoding="utf-8"):
                pass
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root)
            os.rename(away, self.root)

    def outage(self, seconds: float) -> str:
        """What ``gone`` did for ``seconds``, for a row."""
        return f"object store gone {seconds:.0f}s"

    def close(self) -> None:
        """Nothing runs: the directory stays with the run's work directory."""


class GcsStore:
    """fake-gcs-server (objects in ``data_dir``) with bucket ``ckpt``; the agents reach it through an
    ``UnavailableProxy`` (``env``), at ``gs://ckpt/mtc``."""

    kind = "gcs"
    _BUCKET, _PREFIX = "ckpt", "mtc"

    def __init__(self, binary: str, data_dir: str):
        self.server = FakeGcsServer(binary, data_dir=data_dir)
        self.proxy = UnavailableProxy(self.server.port)
        self.server.external_url = self.proxy.url  # resumable uploads are sent back through the proxy too
        self.server.start()
        self.bucket = self.server.client().create_bucket(self._BUCKET)
        self.url, self.env = f"gs://{self._BUCKET}/{self._PREFIX}", {"STORAGE_EMULATOR_HOST": self.proxy.url}

    def _steps(self, job: str) -> str:
        return f"{self._PREFIX}/{NAMESPACE}/{job}/steps/"

    def commits(self, job: str) -> dict[str, float]:
        prefix, found = self._steps(job), {}
        for blob in self.bucket.list_blobs(prefix=prefix):
            entry, _, name = blob.name[len(prefix) :].partition("/")
            if name == "COMMIT":
                found[entry] = blob.updated.timestamp() if blob.updated else time.time()
        return found

    def read(self, job: str, path: str) -> bytes:
        return self.bucket.blob(posixpath.normpath(self._steps(job) + path)).download_as_bytes()

    def exists(self, job: str, path: str) -> bool:
        return self.bucket.blob(posixpath.normpath(self._steps(job) + path)).exists()

    def flip(self, job: str, path: str) -> None:
        data = bytearray(self.read(job, path))
        data[len(data) // 2] ^= 0xFF
        self.bucket.blob(posixpath.normpath(self._steps(job) + path)).upload_from_string(bytes(data))

    def gone(self):
        """Every request answers 503 (``UnavailableProxy.unavailable``) while the context lasts."""
        return self.proxy.unavailable()

    def outage(self, seconds: float) -> str:
        return f"object store answering 503 {seconds:.0f}s ({self.proxy.refused} requests refused)"

    def close(self) -> None:
        self.proxy.stop()
        self.server.stop()
