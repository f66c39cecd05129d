"""TLS connections on loopback through the coordinator's one shared 16 KiB read buffer: an idle connection holds
not even 16 KiB of buffer, and many at once, each sending bodies larger than the buffer, get their own bytes back.
The checks of the private asyncio API the sharing patches: tests/unit/test_tls_read_buffer.py."""

import asyncio
import asyncio.sslproto
import hashlib
import ssl
import tracemalloc

from examples.local_cluster import self_signed_certificate
from replicator.coordinator.api.tls_read_buffer import TLS_READ_BUFFER_BYTES

CONNECTIONS = 40


def contexts(tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = self_signed_certificate(str(tmp_path))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    return server_context, ssl.create_default_context(cafile=cert)


async def memory_per_tls_connection(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> float:
    """Bytes the server side holds per open TLS connection (tracemalloc), over ``CONNECTIONS``."""
    accepted, done = [], asyncio.Event()

    async def serve(reader, writer):
        accepted.append(writer)
        await done.wait()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        clients = [await asyncio.open_connection("127.0.0.1", port, ssl=client_context) for _ in range(CONNECTIONS)]
        while len(accepted) < CONNECTIONS:
            await asyncio.sleep(0.01)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    done.set()
    for _, writer in clients:
        writer.close()
    await asyncio.gather(*(writer.wait_closed() for _, writer in clients), return_exceptions=True)
    server.close()
    await server.wait_closed()
    return held / CONNECTIONS / 2  # both ends are in this process, each with one read buffer


def test_tls_connections_share_one_read_buffer(tmp_path, tls_buffer_sharing):
    server_context, client_context = contexts(tmp_path)
    default = asyncio.run(memory_per_tls_connection(server_context, client_context))
    tls_buffer_sharing()
    tls_buffer_sharing()  # idempotent: still one buffer
    small = asyncio.run(memory_per_tls_connection(server_context, client_context))
    assert default > 256 * 1024  # asyncio's own buffer, for comparison: the test can tell them apart
    assert small < default - 256 * 1024 * 0.95  # not even the 16 KiB of a buffer per connection
    assert asyncio.sslproto.SSLProtocol.max_size == TLS_READ_BUFFER_BYTES


async def echo_digests(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> list[tuple[str, str]]:
    """(sent, received) SHA-256 of a body per connection: ``CONNECTIONS`` clients send at once, each a
    different body of several buffers' size in pieces, and the server hashes what each connection read."""

    async def serve(reader, writer):
        size = int.from_bytes(await reader.readexactly(8), "big")
        writer.write(hashlib.sha256(await reader.readexactly(size)).hexdigest().encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]

    async def client(index: int) -> tuple[str, str]:
        body = bytes([index]) * (3 * TLS_READ_BUFFER_BYTES + 1_000 * index)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context)
        writer.write(len(body).to_bytes(8, "big"))
        for start in range(0, len(body), 5_000):
            writer.write(body[start : start + 5_000])
            await writer.drain()
        received = (await reader.read()).decode()
        writer.close()
        return hashlib.sha256(body).hexdigest(), received

    try:
        return await asyncio.gather(*(client(i) for i in range(CONNECTIONS)))
    finally:
        server.close()
        await server.wait_closed()


def test_connections_reading_into_the_shared_buffer_at_once_each_get_their_own_bytes(tmp_path, tls_buffer_sharing):
    server_context, client_context = contexts(tmp_path)
    tls_buffer_sharing()
    digests = asyncio.run(echo_digests(server_context, client_context))
    assert len(digests) == CONNECTIONS
    assert all(sent == received for sent, received in digests)
