"""Resident memory per idle keep-alive HTTPS connection of an aiohttp server, with asyncio's TLS read
buffer (256 KiB a connection) and with the coordinator's (``share_tls_read_buffer``: one of 16 KiB for all).

The coordinator holds one or two such connections per node, so this is most of what a node costs it
besides its state (``coordinator_sim``). The server runs in a child process (its resident size is
read with psutil: OpenSSL's allocations count, which tracemalloc does not see); the clients here each
make one request, as an agent's report, and keep the connection open.

``python -m tests.bench.connection_memory [--connections 1000]``
"""

import argparse
import asyncio
import asyncio.sslproto
import multiprocessing
import ssl
import sys
import tempfile

import aiohttp
import psutil
from aiohttp import web

from examples.local_cluster import self_signed_certificate
from replicator.coordinator.api.tls_read_buffer import TLS_READ_BUFFER_BYTES, share_tls_read_buffer
from tests.helpers.ports import free_port

REPORT = b'{"node_id": "node-00001", "held": []}' * 25  # about a heartbeat's size
SETTLE_SECONDS = 1.0


def serve(cert: str, key: str, port: int, shared: bool) -> None:
    if shared:
        share_tls_read_buffer()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def report(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"heartbeat_seconds": 10.0})

    app = web.Application()
    app.router.add_post("/v1/report", report)
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=context, print=None)


async def per_connection(cert: str, port: int, server: psutil.Process, connections: int) -> float:
    """Bytes of the server's resident memory per open connection, after one request on each."""
    context = ssl.create_default_context(cafile=cert)
    for _ in range(100):  # until the server listens
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.1)
    await asyncio.sleep(SETTLE_SECONDS)
    idle = server.memory_info().rss
    sessions = []
    try:
        for _ in range(connections):
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=1, keepalive_timeout=600))
            sessions.append(session)
            async with session.post(f"https://127.0.0.1:{port}/v1/report", data=REPORT) as response:
                await response.read()
        await asyncio.sleep(SETTLE_SECONDS)
        return (server.memory_info().rss - idle) / connections
    finally:
        await asyncio.gather(*(s.close() for s in sessions))


def measure(cert: str, key: str, connections: int, shared: bool) -> float:
    port = free_port("127.0.0.1")
    # Spawned, not forked: a fork would start with this process's heap, which the server then reuses.
    child = multiprocessing.get_context("spawn").Process(target=serve, args=(cert, key, port, shared), daemon=True)
    child.start()
    try:
        return asyncio.run(per_connection(cert, port, psutil.Process(child.pid), connections))
    finally:
        child.terminate()
        child.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        cert, key = self_signed_certificate(directory)
        for shared in (False, True):
            buffer = (
                f"one of {TLS_READ_BUFFER_BYTES // 1024} KiB shared"
                if shared
                else f"{asyncio.sslproto.SSLProtocol.max_size // 1024} KiB each"
            )
            kilobytes = measure(cert, key, args.connections, shared) / 1e3
            print(
                f"TLS read buffer {buffer}: {kilobytes:.1f} KB resident per idle keep-alive connection ({args.connections:,} connections)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
