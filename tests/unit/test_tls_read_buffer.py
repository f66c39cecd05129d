"""The coordinator's TLS connections all read into one shared 16 KiB buffer, not asyncio's 256 KiB each
(``replicator/coordinator/api/tls_read_buffer.py``): at 10,000 nodes the default buffers alone were 2.5 GiB of the
coordinator's memory. The sharing patches a private asyncio API on the Pythons it was verified on: the first tests
here fail when the running Python is not one of them, or when that API no longer has what the patch relies on, so
that the memory figures it bought (docs/scale.md) never go unmeasured. Real connections through the shared buffer:
tests/integration/test_tls_read_buffer.py."""

import asyncio
import asyncio.selector_events
import asyncio.sslproto
import inspect
import ssl
import sys

from replicator.coordinator.api import tls_read_buffer
from replicator.coordinator.api.tls_read_buffer import TLS_READ_BUFFER_BYTES, VERIFIED_PYTHONS


def test_the_running_python_is_one_the_shared_read_buffer_was_verified_on():
    assert sys.version_info[:2] in VERIFIED_PYTHONS, (
        "asyncio's TLS read buffer is shared only on the Pythons in tls_read_buffer.VERIFIED_PYTHONS: check that "
        "this one's SSLProtocol still reads as the tests below say, rerun tests.bench.connection_memory, then add it"
    )


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
    return asyncio.sslproto.SSLProtocol(
        loop, asyncio.Protocol(), ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), None, server_side=True
    )


def test_every_protocol_built_after_sharing_reads_into_the_one_buffer(tls_buffer_sharing):
    loop = asyncio.new_event_loop()
    try:
        assert tls_buffer_sharing() is True
        first, second = server_protocol(loop), server_protocol(loop)
        assert first.get_buffer(-1).obj is second.get_buffer(-1).obj  # the same bytearray
        assert len(first.get_buffer(-1)) == len(second.get_buffer(1 << 20)) == TLS_READ_BUFFER_BYTES  # never grown
    finally:
        loop.close()


def test_a_python_the_sharing_was_not_verified_on_keeps_asyncios_own_buffers(tls_buffer_sharing, monkeypatch, caplog):
    protocol = asyncio.sslproto.SSLProtocol
    before = protocol.max_size, protocol.__init__
    monkeypatch.setattr(tls_read_buffer, "VERIFIED_PYTHONS", frozenset())
    assert tls_buffer_sharing() is False
    assert (protocol.max_size, protocol.__init__) == before
    assert "keeps asyncio's own read buffer" in caplog.text
