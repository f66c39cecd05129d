"""The object stores the backup tier is tested against, as real processes on loopback:
fake-gcs-server (GCS's JSON API) and MinIO (S3). ``make tools`` builds both; ``tools.require_tool``
finds them."""

import collections
import os
import re
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
import uuid

import boto3
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from tests.helpers.ports import free_port

# fake-gcs-server's access log (``-log-level info``): a common-log-format line per request.
_REQUEST_LINE = re.compile(r'\\?"(GET|POST|PUT|PATCH|DELETE|HEAD) (\S+) HTTP/[\d.]+\\?"')


class ServerProcess:
    """A test server on a free 127.0.0.1 port, ready once ``health_path`` answers; what the emulators share.

    Subclasses give ``name``, ``health_path`` and ``command()``, and may add environment in ``env()``.

    Args:
      binary: the server's executable.
    """

    name = "server"
    health_path = "/"

    def __init__(self, binary: str):
        self.binary = binary
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = self._open_log()
        self._process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def _open_log(self):
        """Where the server's output goes (read back when it fails to start)."""
        return tempfile.TemporaryFile()

    def start(self, timeout_seconds: float = 30.0) -> "ServerProcess":
        """Starts the server (again, after ``stop``, on the same port) and waits until it answers.

        Raises:
          RuntimeError: it exited or did not answer in time; the message holds its output.
        """
        if self._log.closed:
            self._log = self._open_log()
        self._process = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env()}
        )
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline and self._process.poll() is None:
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self._log.seek(0)
        output = self._log.read().decode(errors="replace")
        self.stop()
        raise RuntimeError(f"{self.name} on {self.url} did not start: {output}")

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after 10 s); idempotent."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    @property
    def pid(self) -> int:
        return self._process.pid


class FakeGcsServer(ServerProcess):
    """fake-gcs-server: GCS's JSON API for the real google-cloud-storage client, as an emulator.

    ``-external-url`` is set so that resumable uploads (files over 8 MiB) are sent back to it.

    Args:
      binary: the fake-gcs-server executable.
      data_dir: keep objects in this directory (they survive a restart), or None for memory.
      request_log: log every request the server answers to this file (``requests``), or None.
      external_url: the URL clients reach it by (a proxy in front of it), or None for its own.
    """

    name = "fake-gcs-server"
    health_path = "/storage/v1/b"

    def __init__(
        self, binary: str, data_dir: str | None = None, request_log: str | None = None, external_url: str | None = None
    ):
        self.request_log = request_log
        super().__init__(binary)
        self.data_dir = data_dir
        self.external_url = external_url or self.url

    def _open_log(self):
        # Appended to by the server, so ``requests`` reads it while it runs without moving its offset.
        return open(self.request_log, "ab") if self.request_log else super()._open_log()  # closed by ``stop``

    def requests(self) -> list[tuple[str, str]]:
        """(method, path with query) of every request answered so far, oldest first (``request_log``)."""
        with open(self.request_log, encoding="utf-8", errors="replace") as log:
            return [(m.group(1), m.group(2)) for m in _REQUEST_LINE.finditer(log.read())]

    def object_reads(self, bucket: str, prefix: str = "") -> collections.Counter:
        """Object name -> how many times its content was served (media downloads), for names under ``prefix``."""
        reads: collections.Counter = collections.Counter()
        for method, path in self.requests():
            found = re.match(rf"/download/storage/v1/b/{bucket}/o/([^?]+)\?(?:.*&)?alt=media", path)
            if method == "GET" and found and (name := urllib.parse.unquote(found.group(1))).startswith(prefix):
                reads[name] += 1
        return reads

    def command(self) -> list[str]:
        if self.data_dir:
            os.makedirs(self.data_dir, exist_ok=True)
        backend = (
            ["-backend", "filesystem", "-filesystem-root", self.data_dir] if self.data_dir else ["-backend", "memory"]
        )
        return [
            self.binary,
            "-scheme",
            "http",
            *backend,
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-external-url",
            self.external_url,
            "-log-level",
            "info" if self.request_log else "error",
        ]

    def client(self) -> storage.Client:
        """A google-cloud-storage client of this server (anonymous, project ``test``)."""
        return storage.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.url}
        )


class MinioServer(ServerProcess):
    """A real MinIO server (S3 API), single drive, for tests and benches only: MinIO is AGPL and is
    never linked or shipped. The console is off; root credentials are random per server.

    Args:
      binary: the minio executable (``make tools``).
      data_dir: where it keeps objects; they survive a restart.
    """

    name = "minio"
    health_path = "/minio/health/live"

    def __init__(self, binary: str, data_dir: str):
        super().__init__(binary)
        self.data_dir = data_dir
        self.access_key, self.secret_key = "mtc-" + uuid.uuid4().hex[:12], uuid.uuid4().hex

    def command(self) -> list[str]:
        return [self.binary, "server", self.data_dir, "--address", f"127.0.0.1:{self.port}", "--quiet"]

    def env(self) -> dict[str, str]:
        return {
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
        }

    def client_env(self) -> dict[str, str]:
        """What an S3 client needs to reach this server through boto3's standard configuration."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self):
        """A boto3 S3 client of this server, with its root credentials."""
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )
