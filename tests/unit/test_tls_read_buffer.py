"""The coordinator's TLS connections read into 16 KiB, not asyncio's 256 KiB each: at 10,000 nodes
the default buffers alone were 2.5 GiB of the coordinator's memory."""

import asyncio
import asyncio.sslproto
import ssl
import tracemalloc

import pytest

from examples.local_cluster import self_signed_certificate
from replicator.coordinator.service import TLS_READ_BUFFER_BYTES, shrink_tls_read_buffers

CONNECTIONS = 40


@pytest.fixture
def shrunk():
    """``shrink_tls_read_buffers`` applied to this process, undone afterwards."""
    before = asyncio.sslproto.SSLProtocol.max_size
    yield shrink_tls_read_buffers
    asyncio.sslproto.SSLProtocol.max_size = before


async def memory_per_tls_connection(cert: str, key: str) -> float:
    """Bytes the server side holds per open TLS connection (tracemalloc), over ``CONNECTIONS``."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=cert)
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


def test_a_tls_connection_holds_a_16_kib_read_buffer_not_256(tmp_path, shrunk):
    cert, key = self_signed_certificate(str(tmp_path))
    default = asyncio.run(memory_per_tls_connection(cert, key))
    shrunk()
    small = asyncio.run(memory_per_tls_connection(cert, key))
    assert default > 256 * 1024  # asyncio's own buffer, for comparison: the test can tell them apart
    assert small < default - (256 * 1024 - TLS_READ_BUFFER_BYTES) * 0.9
