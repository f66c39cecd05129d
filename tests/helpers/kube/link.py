"""A TCP link to the API server that a test can cut: the coordinator's view of an API-server outage, leaving the
control plane's own controllers undisturbed (a restarted kube-apiserver keeps them catching up for minutes here)."""

import asyncio
import contextlib
import threading
from pathlib import Path

import yaml

from tests.helpers.ports import free_port


class CuttableLink:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (``host:port``) from a thread of its own.

    ``cut()`` closes every forwarded connection and closes each new one at once, as an unreachable server would
    (TLS passes through untouched: the server's certificate still names 127.0.0.1); ``restore()`` forwards again.
    """

    def __init__(self, upstream: str):
        self._host, _, port = upstream.rpartition(":")
        self._upstream_port = int(port)
        self.port = free_port()
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cuttable-link", daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> "CuttableLink":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def cut(self) -> None:
        """Every connection is closed, and new ones are until ``restore``."""
        self._cut = True
        asyncio.run_coroutine_threadsafe(self._close_connections(), self._loop).result(timeout=10)

    def restore(self) -> None:
        self._cut = False

    def kubeconfig(self, source: Path, path: Path) -> Path:
        """``source`` with its clusters' server pointed at this link, written to ``path``."""
        config = yaml.safe_load(source.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path.write_text(yaml.safe_dump(config))
        return path

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._close_connections()

    async def _close_connections(self) -> None:
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self._host, self._upstream_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, upstream_writer}
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        self._writers -= {writer, upstream_writer}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until either side ends, then closes the writer."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.close()
