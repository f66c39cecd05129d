"""The peer tier's client: fetch a rank's step from another node agent, or push a replica to one.

It speaks ``replicator.peer_tier.protocol`` to ``replicator.peer_tier.service``. A fetch runs on several
threads, one HTTP connection each (``http.client``, so every socket read, file write and checksum
runs with the GIL released): each thread GETs large byte ranges and writes them in place with
``os.pwrite`` into files created at full size. Every file is checked against the manifest the caller
expects (the owner's, from the restore plan) before the fetch returns: the CRC-32C of each range is
taken from the bytes as they arrive and the ranges' CRCs are combined, so a restore touches each
byte once instead of reading the whole step back. A push streams each file from disk, then commits;
the peer installs the replica only if every checksum matches.
"""

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import http.client
import os
import queue
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from replicator.local_tier import pod_files
from replicator.local_tier.incoming import pwrite_all
from replicator.local_tier.step_manifest import (
    CorruptCopy,
    StepManifest,
    UnusableCopy,
    crc32c_combine,
    crc32c_extend,
    safe_relpath,
)
from replicator.pacing import timing
from replicator.pacing.cpu_share import CpuShare
from replicator.peer_tier.protocol import (
    COMMIT_SUFFIX,
    FILES_SUFFIX,
    MANIFEST_SUFFIX,
    SHARD_SUFFIX,
    STEP_BYTES_HEADER,
    STEP_PATH,
    UPLOAD_HEADER,
)
from replicator.wire.bearer import auth_header
from replicator.wire.grants import GRANT_HEADER
from replicator.wire.http_errors import error_of

MiB = 1 << 20
# One GET per range: large enough that HTTP costs nothing per byte, small enough to spread a file over
# the workers. Each read lands in one reused buffer that stays in the CPU cache between the write and
# the checksum.
DEFAULT_RANGE_BYTES = 64 * MiB
_READ_BYTES = 2 * MiB
_MAX_ERROR_BODY_BYTES = 64 << 10
# A kept-alive connection idle longer is closed, not reused: well inside aiohttp's 75 s keep-alive, after which the
# peer service closes it and a request on it would fail.
_IDLE_SECONDS = 15.0


class PeerFetchError(Exception):
    """A peer could not serve or accept a step: connection or HTTP error, or data failing its checksums."""


class UnusablePeerCopy(PeerFetchError, UnusableCopy):
    """The peer does not hold the copy (HTTP 404/410) or sent an unusable manifest for it."""


class CorruptPeerCopy(UnusablePeerCopy, CorruptCopy):
    """The peer's copy fails its checksums."""


def _step_url(base_url: str, namespace: str, job: str, rank: int, step: int) -> str:
    return base_url.rstrip("/") + STEP_PATH.format(namespace=namespace, job=job, rank=rank, step=step)


def _file_url(step_url: str, rel: str) -> str:
    return step_url + FILES_SUFFIX + urllib.parse.quote(rel, safe="/")


def _error_message(status: int, text: str) -> str:
    """``HTTP <status>: <error>; <problems>`` from a peer's JSON error body, or the start of the body."""
    return f"HTTP {status}: {error_of(text)}"


def _error_kind(status: int) -> type[PeerFetchError]:
    """A 404 or 410 proves the peer no longer holds the copy; other statuses may pass."""
    return UnusablePeerCopy if status in (404, 410) else PeerFetchError


async def _raise_for(response: aiohttp.ClientResponse, what: str) -> None:
    """Raises PeerFetchError (UnusablePeerCopy for 404/410) with the peer's ``{"error"}`` unless ``response`` is a 2xx."""
    if response.status >= 300:
        raise _error_kind(response.status)(
            f"{what}: {_error_message(response.status, await response.text(errors='replace'))}"
        )


async def run_all(jobs: list[Callable[[], Awaitable]], concurrency: int) -> list:
    """Runs ``jobs`` with at most ``concurrency`` at a time; returns their results in order.
    The first error cancels the rest."""
    results = [None] * len(jobs)
    pending = iter(enumerate(jobs))

    async def worker() -> None:
        for i, job in pending:  # a shared iterator: each job runs once
            results[i] = await job()

    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(jobs)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return results


def _headers(token: str, grant: str | None) -> dict[str, str]:
    """The bearer token, and the coordinator's grant for the request's copy where it issued one."""
    return {**auth_header(token), **({GRANT_HEADER: grant} if grant else {})}


async def fetch_manifest(
    session: aiohttp.ClientSession,
    base_url: str,
    token: str,
    namespace: str,
    job: str,
    rank: int,
    step: int,
    grant: str | None = None,
) -> StepManifest:
    """The manifest a peer holds for ``rank``'s ``step`` (``grant``: the coordinator's, for a peer that needs one).

    Raises:
      PeerFetchError: the peer could not be reached, answered an error, or sent a manifest for another
        rank or step or with unsafe paths.
    """
    url = _step_url(base_url, namespace, job, rank, step)
    try:
        async with session.get(url + MANIFEST_SUFFIX, headers=_headers(token, grant)) as response:
            await _raise_for(response, f"GET {url}{MANIFEST_SUFFIX}")
            manifest = StepManifest.from_json(await response.text())
        for rel in manifest.files:
            safe_relpath(rel)
    except (ValueError, KeyError, TypeError) as err:
        raise UnusablePeerCopy(f"{url}{MANIFEST_SUFFIX}: not a usable manifest: {err!r}") from None
    except (TimeoutError, aiohttp.ClientError) as err:
        raise PeerFetchError(f"GET {url}{MANIFEST_SUFFIX}: {err!r}") from None
    if (manifest.rank, manifest.step) != (rank, step):
        raise UnusablePeerCopy(f"{url}: the peer sent the manifest of rank {manifest.rank} step {manifest.step}")
    return manifest


def _create_files(dest_dir: str, manifest: StepManifest) -> dict[str, int]:
    """Creates every file of ``manifest`` under ``dest_dir`` at its full size; returns them open for writing.

    ``ftruncate``, not ``posix_fallocate``: on tmpfs the latter zero-fills every page before the
    data overwrites it (0.3 s per GiB, a third of a loopback transfer). A full disk is caught here
    by the free-space check instead.

    Returns:
      relative path -> descriptor open for writing; the caller closes them.

    Raises:
      OSError: ENOSPC when the filesystem of ``dest_dir`` has less free space than the step's bytes.
    """
    stats = os.statvfs(dest_dir)
    if stats.f_bavail * stats.f_frsize < manifest.total_bytes:
        raise OSError(
            errno.ENOSPC,
            f"{dest_dir} has {stats.f_bavail * stats.f_frsize} bytes free,"
            f" step {manifest.step} of rank {manifest.rank} needs {manifest.total_bytes}",
        )
    fds = {}
    try:
        for rel, (size, _) in manifest.files.items():
            path = os.path.join(dest_dir, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fds[rel] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            os.ftruncate(fds[rel], size)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


class _Peer:
    """Where a fetch reads from: a peer's base URL, parsed, with what every GET carries."""

    def __init__(
        self, base_url: str, token: str, grant: str | None, ssl_context: ssl.SSLContext | None, timeout: float
    ):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PeerFetchError(f"{base_url!r} is not an http:// or https:// URL")
        self.base_url, self.scheme, self.host, self.port = base_url, parts.scheme, parts.hostname, parts.port
        self.path = parts.path.rstrip("/")
        self.headers = _headers(token, grant)
        self.ssl_context, self.timeout = ssl_context, timeout

    def connect(self) -> http.client.HTTPConnection:
        """A new connection (opened on first request); ``timeout`` bounds connecting and every read."""
        if self.scheme == "https":
            # No context: http.client's default (the system's CAs), as aiohttp's.
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.ssl_context)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)


class _Stopped(Exception):
    """A range given up because another one failed."""


@contextlib.contextmanager
def _network(what: str):
    """Turns a failed connection (refused, reset, timed out, TLS, malformed HTTP) into PeerFetchError."""
    try:
        yield
    except (OSError, http.client.HTTPException) as err:
        raise PeerFetchError(f"{what}: {err!r}") from None


def _ranged_response(
    connection: http.client.HTTPConnection, headers: dict[str, str], what: str, path: str, start: int, end: int
) -> http.client.HTTPResponse:
    """Sends a GET of bytes [start, end) of URL path ``path``; returns the response once it is that range.

    Raises:
      PeerFetchError: the connection failed, an error status, or a response other than exactly the range asked
        for (the connection is closed then).
    """
    with _network(what):
        connection.request("GET", path, headers={**headers, "Range": f"bytes={start}-{end - 1}"})
        response = connection.getresponse()
        if response.status != 206:
            body = response.read(_MAX_ERROR_BODY_BYTES).decode(errors="replace")
            connection.close()
            raise _error_kind(response.status)(
                f"{what}: {_error_message(response.status, body)}"
                if response.status >= 300
                else f"{what}: HTTP {response.status} instead of 206 Partial Content"
            )
    if response.length != end - start:
        connection.close()
        raise PeerFetchError(f"{what}: the peer answers with {response.length} bytes")
    return response


def _get_range(
    connection: http.client.HTTPConnection, peer: _Peer, path: str, fd: int, start: int, end: int, stop: threading.Event
) -> int:
    """GETs bytes [start, end) of the file at URL path ``path`` into the same offsets of ``fd``.

    Returns:
      The CRC-32C of the bytes received.

    Raises:
      PeerFetchError: as ``_ranged_response``, or the peer sent fewer bytes.
      _Stopped: ``stop`` was set (another range failed).
      OSError: writing to ``fd`` failed, e.g. ENOSPC.
    """
    what = f"GET {peer.base_url}{path} bytes {start}-{end - 1}"
    response = _ranged_response(connection, peer.headers, what, path, start, end)
    buffer = memoryview(bytearray(min(_READ_BYTES, end - start)))
    crc, offset = 0, start
    while offset < end:
        if stop.is_set():
            connection.close()
            raise _Stopped()
        with _network(what):
            received = response.readinto(buffer[: end - offset])
        if not received:
            raise PeerFetchError(f"{what}: the peer sent {offset - start} bytes")
        pwrite_all(fd, buffer[:received], offset)
        crc = crc32c_extend(crc, buffer[:received])
        offset += received
    return crc


class RangeReads:
    """Blocking ranged GETs from peers straight into the caller's buffers, for worker threads: each socket read
    lands in place with the GIL released, as a fetch's do, where aiohttp would copy every read twice on the event
    loop's one thread. Connections are kept alive between reads, a pool per peer, and closed by ``close``.

    Args:
      token: the peer tier's bearer token.
      ssl_context: TLS for ``https://`` peers (the peer CA); None for the system's defaults.
      timeout: seconds allowed to connect and for each socket read.
    """

    def __init__(
        self, token: str, ssl_context: ssl.SSLContext | None, timeout: float = timing.PEER_READ_TIMEOUT_SECONDS
    ):
        self._token, self._ssl, self._timeout = token, ssl_context, timeout
        self._idle: dict[str, queue.SimpleQueue[tuple[http.client.HTTPConnection, float]]] = {}  # (it, idle since)
        self._lock = threading.Lock()
        self._closed = False

    def read_into(self, url: str, offset: int, into: memoryview, grant: str | None = None) -> None:
        """Reads bytes ``[offset, offset + len(into))`` of one file a peer serves (a step's file or a parity
        shard) into ``into`` (blocks: call it on a worker thread).

        Raises:
          PeerFetchError: not reached, an error status, or not exactly the bytes asked (``UnusablePeerCopy`` for
            404/410), or a URL other than http(s).
        """
        parts = urllib.parse.urlsplit(url)
        peer = _Peer(f"{parts.scheme}://{parts.netloc}", self._token, grant, self._ssl, self._timeout)
        what = f"GET {url} bytes {offset}+{len(into)}"
        connection = self._take(peer)
        try:
            response = _ranged_response(connection, peer.headers, what, parts.path, offset, offset + len(into))
            at = 0
            while at < len(into):
                with _network(what):
                    received = response.readinto(into[at:])
                if not received:
                    raise PeerFetchError(f"{what}: the peer sent {at} bytes")
                at += received
        except BaseException:
            connection.close()
            raise
        self._give_back(peer.base_url, connection)

    def _take(self, peer: _Peer) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.setdefault(peer.base_url, queue.SimpleQueue())
        with contextlib.suppress(queue.Empty):
            while True:
                connection, since = idle.get_nowait()
                if time.monotonic() - since < _IDLE_SECONDS:
                    return connection
                connection.close()
        return peer.connect()

    def _give_back(self, base_url: str, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle[base_url].put((connection, time.monotonic()))
                return
        connection.close()  # a read that ran on after ``close``

    def close(self) -> None:
        """Closes the idle connections; a read still running closes its own when it ends."""
        with self._lock:
            self._closed = True
            pools, self._idle = list(self._idle.values()), {}
        for idle in pools:
            with contextlib.suppress(queue.Empty):
                while True:
                    idle.get_nowait()[0].close()


def _download(
    peer: _Peer,
    step_path: str,
    ranges: list[tuple[str, int, int]],
    fds: dict[str, int],
    workers: int,
    stop: threading.Event,
    on_range: Callable[[int], None] | None = None,
) -> list[int]:
    """Fetches ``ranges`` ((relative path, start, end)) on ``workers`` threads, one connection each;
    returns each range's CRC-32C, in order, and calls ``on_range`` with each range's length as it
    lands. The first failure stops the others and is raised."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(len(ranges)):
        pending.put(index)
    crcs = [0] * len(ranges)

    def worker() -> None:
        connection = peer.connect()
        try:
            while not stop.is_set():
                try:
                    index = pending.get_nowait()
                except queue.Empty:
                    return
                rel, start, end = ranges[index]
                path = _file_url(step_path, rel)
                crcs[index] = _get_range(connection, peer, path, fds[rel], start, end, stop)
                if on_range is not None:
                    on_range(end - start)
        except BaseException:
            stop.set()
            raise
        finally:
            connection.close()

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="peer-fetch") as pool:
        futures = [pool.submit(worker) for _ in range(min(workers, len(ranges)))]
    errors = [error for f in futures if (error := f.exception()) is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
    return crcs


async def fetch_step(
    base_url: str,
    token: str,
    namespace: str,
    job: str,
    manifest: StepManifest,
    dest_dir: str,
    *,
    ssl_context: ssl.SSLContext | None = None,
    workers: int | None = None,
    range_bytes: int = DEFAULT_RANGE_BYTES,
    timeout: float = timing.PEER_READ_TIMEOUT_SECONDS,
    on_range: Callable[[int], None] | None = None,
    grant: str | None = None,
) -> None:
    """Downloads ``manifest``'s rank and step from a peer into ``dest_dir`` and checks every byte against it.

    Args:
      base_url: the peer's node agent, e.g. ``http://10.0.0.2:8470`` or ``https://...``.
      token: the shared peer secret.
      namespace, job: the job, DNS-1123 labels.
      manifest: what the step must be: the owning rank's checksums, from the restore plan (not the
        serving peer's word). Its rank and step say what to fetch.
      dest_dir: an empty directory on the destination filesystem, e.g. ``JobMeta.new_incoming_dir()``.
        On error it holds partial data; the caller deletes it.
      ssl_context: TLS for ``https://`` peers (the peer CA); None for the system's defaults.
      workers: threads, each with its own connection; None for one per CPU.
      range_bytes: the largest range one GET asks for, bytes.
      timeout: seconds allowed to connect and for each read; a stalled peer fails the fetch.
      on_range: called (from a worker thread) with each range's length in bytes once it is written, or None.
      grant: the coordinator's grant to fetch the step from this peer (``replicator.wire.grants``), or None.

    Raises:
      PeerFetchError: the peer could not be reached or answered an error, or ``manifest`` has an
        unsafe path; ``CorruptPeerCopy`` when it sent data that does not match ``manifest`` (names
        the files), ``UnusablePeerCopy`` when it does not hold the step (HTTP 404/410).
      OSError: ``dest_dir`` could not be written, e.g. ENOSPC.
    """
    try:
        for rel in manifest.files:
            safe_relpath(rel)
    except ValueError as err:
        raise PeerFetchError(f"the expected manifest of rank {manifest.rank} step {manifest.step}: {err}") from None
    peer = _Peer(base_url, token, grant, ssl_context, timeout)
    step_path = peer.path + _step_url("", namespace, job, manifest.rank, manifest.step)
    ranges = [
        (rel, start, min(start + range_bytes, size))
        for rel, (size, _) in manifest.files.items()
        for start in range(0, size, range_bytes)
    ]
    fds = await asyncio.to_thread(_create_files, dest_dir, manifest)
    range_crcs = await _download_ranges(peer, step_path, ranges, fds, workers or os.cpu_count() or 1, on_range)
    _verify(manifest, ranges, range_crcs, base_url)


async def _download_ranges(
    peer: _Peer,
    step_path: str,
    ranges: list[tuple[str, int, int]],
    fds: dict[str, int],
    workers: int,
    on_range: Callable[[int], None] | None,
) -> list[int]:
    """Downloads ``ranges`` ((path, start, end) in bytes) into the open files ``fds`` on ``workers`` threads, then
    closes them; returns each range's CRC-32C, in order. A cancel stops the threads within one read and waits for
    them (the caller deletes the files next)."""
    stop = threading.Event()
    try:
        download = asyncio.ensure_future(
            asyncio.to_thread(_download, peer, step_path, ranges, fds, workers, stop, on_range)
        )
        try:
            return await asyncio.shield(download)
        except asyncio.CancelledError:
            stop.set()  # the threads stop within one read; wait for them before the caller deletes dest_dir
            await asyncio.wait([download])
            raise
    finally:
        for fd in fds.values():
            os.close(fd)


def _verify(manifest: StepManifest, ranges: list[tuple[str, int, int]], range_crcs: list[int], base_url: str) -> None:
    """Raises CorruptPeerCopy naming the files whose ranges' CRC-32Cs, combined, are not ``manifest``'s."""
    file_crcs = dict.fromkeys(manifest.files, 0)  # 0 is the CRC-32C of no bytes
    for (rel, start, end), crc in zip(ranges, range_crcs):  # a file's ranges are in offset order
        file_crcs[rel] = crc32c_combine(file_crcs[rel], crc, end - start)
    problems = [f"{rel}: crc32c mismatch" for rel, (_, crc) in manifest.files.items() if f"{file_crcs[rel]:08x}" != crc]
    if problems:
        raise CorruptPeerCopy(
            f"rank {manifest.rank} step {manifest.step} from {base_url} fails verification: {'; '.join(problems)}"
        )


async def _file_body(fd: int, size: int, share: CpuShare | None) -> AsyncIterator[bytes]:
    """The first ``size`` bytes of an open file in reads of ``_READ_BYTES`` (off the event loop),
    pausing for ``share`` after each."""
    offset = 0
    while offset < size and (chunk := await asyncio.to_thread(os.pread, fd, min(_READ_BYTES, size - offset), offset)):
        yield chunk
        offset += len(chunk)
        if share is not None:
            await share.wait()


async def push_step(
    session: aiohttp.ClientSession,
    base_url: str,
    token: str,
    namespace: str,
    job: str,
    step_dir: str,
    manifest: StepManifest,
    concurrency: int = 4,
    share: CpuShare | None = None,
    grant: str | None = None,
) -> None:
    """Pushes a step to a peer as a replica: every file streamed from disk, then a commit.

    The peer verifies the files against ``manifest`` and only then installs them, replacing any
    replica it held of the same rank and step.

    Args:
      session: the client session (its timeout bounds the whole push).
      base_url, token, namespace, job: as for ``fetch_step``.
      step_dir: the directory holding the step's files.
      manifest: their checksums; its rank and step name the replica.
      concurrency: files uploaded at once.
      share: the agent's CPU cap while the job trains, or None.
      grant: the coordinator's grant to push the step to this peer (``replicator.wire.grants``), or None.

    Raises:
      PeerFetchError: the peer could not be reached or refused a file or the commit (507 when the
        step does not fit on its ramdisk beside its job's next save, 422 with the problems when the files do not match ``manifest``).
      OSError: a file of ``step_dir`` could not be read; ``pod_files.UnsafeEntry`` when it is not a
        regular file.
    """
    url = _step_url(base_url, namespace, job, manifest.rank, manifest.step)
    headers = {**_headers(token, grant), UPLOAD_HEADER: uuid.uuid4().hex, STEP_BYTES_HEADER: str(manifest.total_bytes)}

    async def put(root: int, rel: str) -> None:
        # Opened without following links: the step may be the pod's own directory.
        fd = pod_files.open_relative(root, rel)
        try:
            size = os.fstat(fd).st_size  # sent as Content-Length: the peer refuses what cannot fit before it is sent
            async with session.put(
                _file_url(url, rel), data=_file_body(fd, size, share), headers={**headers, "Content-Length": str(size)}
            ) as response:
                await _raise_for(response, f"PUT {rel} to {base_url}")
        finally:
            os.close(fd)

    try:
        with pod_files.open_dir(step_dir) as root:
            await run_all([functools.partial(put, root, rel) for rel in manifest.files], concurrency)
        async with session.post(
            url + COMMIT_SUFFIX, data=manifest.to_json(), headers={**headers, "Content-Type": "application/json"}
        ) as response:
            await _raise_for(response, f"commit of rank {manifest.rank} step {manifest.step} to {base_url}")
    except (TimeoutError, aiohttp.ClientError) as err:
        raise PeerFetchError(f"pushing rank {manifest.rank} step {manifest.step} to {base_url}: {err!r}") from None


def file_url(base_url: str, namespace: str, job: str, rank: int, step: int, rel: str) -> str:
    """The URL of one file of a rank's step on a peer."""
    return _file_url(_step_url(base_url, namespace, job, rank, step), rel)


def shard_url(base_url: str, namespace: str, job: str, group: int, step: int, stripe: int) -> str:
    """The URL of a parity shard on a peer: stripe ``stripe`` of the group whose first member is ``group``."""
    return _step_url(base_url, namespace, job, group, step) + SHARD_SUFFIX + str(stripe)
