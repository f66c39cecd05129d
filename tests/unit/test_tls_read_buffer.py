"""The coordinator's TLS connections all read into one shared 16 KiB buffer, not asyncio's 256 KiB each:
at 10,000 nodes the default buffers alone were 2.5 GiB of the coordinator's memory, and 16 KiB per
connection was still a third of what an idle connection held. Sharing it must not mix up connections:
many at once, each sending bodies larger than the buffer, get their own bytes back.

The sharing patches a private asyncio API on the Pythons it was verified on: the first tests here fail
when the running Python is not one of them, or when that API no longer has what the patch relies on,
so that the memory figures it bought (docs/scale.md) never go unmeasured."""

import asyncio
import asyncio.selector_events
import asyncio.sslproto
import hashlib
import inspect
import ssl
import sys
import tracemalloc

import pytest

from examples.local_cluster import self_signed_certificate
from replicator.coordinator import tls_read_buffer
from replicator.coordinator.tls_read_buffer import TLS_READ_BUFFER_BYTES, VERIFIED_PYTHONS, share_tls_read_buffer

CONNECTIONS = 40


@pytest.fixture
def shared():
    """``share_tls_read_buffer`` applied to this process, undone afterwards."""
    protocol = asyncio.sslproto.SSLProtocol
    before = protocol.max_size, protocol.__init__
    yield share_tls_read_buffer
    protocol.max_size, protocol.__init__ = before


def test_the_running_python_is_one_the_shared_read_buffer_was_verified_on():
    assert sys.version_info[:2] in VERIFIED_PYTHONS, (
        "asyncio's TLS read buffer is shared only on the Pythons in tls_read_buffer.VERIFIED_PYTHONS: check that "
        "this one's SSLProtocol still reads as the tests below say, rerun tests.bench.connection_memory, then add it")


def test_asyncio_still_reads_tls_through_the_attributes_the_shared_buffer_replaces():
    protocol = asyncio.sslproto.SSLProtocol
    assert protocol.max_size == 256 * 1024  # asyncio's own size, replaced by the patch
    # __init__ allocates the buffer and its view; get_buffer and buffer_updated use nothing else to read.
    assert {"_ssl_buffer", "_ssl_buffer_view", "max_size"} <= set(protocol.__init__.__code__.co_names)
    assert {"_ssl_buffer", "_ssl_buffer_view", "max_size"} <= set(protocol.get_buffer.__code__.co_names)
    assert "_ssl_buffer_view" in protocol.buffer_updated.__code__.co_names
    # The selector transport receives into the buffer and hands it over in the same call: no other
    # connection can land in it in between.
    read = asyncio.selector_events._SelectorSocketTransport._read_ready__get_buffer
    assert {"get_buffer", "recv_into", "buffer_updated"} <= set(read.__code__.co_names)
    assert not inspect.iscoroutinefunction(read)  # no await between them


def server_protocol(loop: asyncio.AbstractEventLoop) -> asyncio.sslproto.SSLProtocol:
    """A server-side ``SSLProtocol``, as asyncio builds one for an accepted connection (no socket)."""
    return asyncio.sslproto.SSLProtocol(loop, asyncio.Protocol(), ssl.create_default_context(ssl.Purpose.CLIENT_AUTH),
                                        None, server_side=True)


def test_every_protocol_built_after_sharing_reads_into_the_one_buffer(shared):
    loop = asyncio.new_event_loop()
    try:
        assert shared() is True
        first, second = server_protocol(loop), server_protocol(loop)
        assert first.get_buffer(-1).obj is second.get_buffer(-1).obj  # the same bytearray
        assert len(first.get_buffer(-1)) == len(second.get_buffer(1 << 20)) == TLS_READ_BUFFER_BYTES  # never grown
    finally:
        loop.close()


def test_a_python_the_sharing_was_not_verified_on_keeps_asyncios_own_buffers(shared, monkeypatch, caplog):
    protocol = asyncio.sslproto.SSLProtocol
    before = protocol.max_size, protocol.__init__
    monkeypatch.setattr(tls_read_buffer, "VERIFIED_PYTHONS", frozenset())
    assert shared() is False
    assert (protocol.max_size, protocol.__init__) == before
    assert "keeps asyncio's own read buffer" in caplog.text


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


def test_tls_connections_share_one_read_buffer(tmp_path, shared):
    server_context, client_context = contexts(tmp_path)
    default = asyncio.run(memory_per_tls_connection(server_context, client_context))
    shared()
    shared()  # idempotent: still one buffer
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
            writer.write(body[start:start + 5_000])
            await writer.drain()
        received = (await reader.read()).decode()
        writer.close()
        return hashlib.sha256(body).hexdigest(), received

    try:
        return await asyncio.gather(*(client(i) for i in range(CONNECTIONS)))
    finally:
        server.close()
        await server.wait_closed()


def test_connections_reading_into_the_shared_buffer_at_once_each_get_their_own_bytes(tmp_path, shared):
    server_context, client_context = contexts(tmp_path)
    shared()
    digests = asyncio.run(echo_digests(server_context, client_context))
    assert len(digests) == CONNECTIONS
    assert all(sent == received for sent, received in digests)
