"""A TCP proxy in front of an object-store emulator that can answer every request with HTTP 503 for a while, as a
store's front end does in an outage (issue 49's chaos fault "a store that answers 503 for 60 s").

While the store is up, each connection is piped to the emulator as it is. ``unavailable()`` resets the open
connections (requests in flight fail as a front end dropping them would) and, until it ends, answers each new
request ``503 Service Unavailable`` with a JSON body and ``Connection: close``; the request's body is read and
dropped first, so the client reads the answer rather than a reset. It runs an asyncio loop on a thread of its own.
"""

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

_HEAD_LIMIT = 64 * 1024  # bytes of a request's line and headers, at most
_DRAIN_SECONDS = 5.0  # reading a refused request's body gives up after this
_BODY = b'{"error": {"code": 503, "message": "the store is unavailable (chaos)"}}'
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


class UnavailableProxy:
    """Listens on a free 127.0.0.1 port (``url``) and forwards to ``127.0.0.1:upstream_port``.

    Attributes:
      refused: requests answered 503 in the last ``unavailable()``.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.refused = 0
        self._down = False
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="store-proxy", daemon=True)
        self._thread.start()
        started.wait()
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()
        server.close()
        if tasks := asyncio.all_tasks(self._loop):  # the connections still open: ended within the loop
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.wait(tasks))
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @contextlib.contextmanager
    def unavailable(self) -> Iterator[None]:
        """Every request answers 503 while the context lasts; the connections open as it begins are reset."""

        def down():
            self._down, self.refused = True, 0
            for writer in list(self._open):
                _reset(writer)

        self._loop.call_soon_threadsafe(down)
        try:
            yield
        finally:
            self._loop.call_soon_threadsafe(setattr, self, "_down", False)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await (self._refuse(reader, writer) if self._down else self._forward(reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            _reset(writer)
        finally:
            writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _DRAIN_SECONDS)
        if len(head) > _HEAD_LIMIT:
            raise OSError("request head too long")
        length = next(
            (
                int(v)
                for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            ),
            0,
        )
        with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError):
            await asyncio.wait_for(reader.readexactly(length), _DRAIN_SECONDS)
        self.refused += 1
        writer.write(_REFUSAL)
        await writer.drain()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._open |= {writer, upstream_writer}
        try:
            pipes = [
                asyncio.ensure_future(_pipe(reader, upstream_writer)),
                asyncio.ensure_future(_pipe(upstream_reader, writer)),
            ]
            try:
                await asyncio.gather(*pipes)
            finally:
                for pipe in pipes:
                    pipe.cancel()
        finally:
            self._open -= {writer, upstream_writer}
            upstream_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(64 * 1024):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with a reset (linger 0), as a front end dropping the connection does."""
    with contextlib.suppress(OSError):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
