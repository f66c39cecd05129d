"""One TLS read buffer for the whole coordinator process, not asyncio's 256 KiB per connection.

asyncio's TLS transport gives every connection a read buffer of ``SSLProtocol.max_size``, 256 KiB,
allocated and zeroed when the connection opens (python/cpython#109534): 2.5 GiB of the 4.2 GB the
coordinator held at 10,000 nodes with one connection each. A TLS record holds at most 16 KiB, so one
record a read costs nothing measurable. The buffer is only a landing place: the transport receives into
it and the protocol copies what came into OpenSSL's input at once, in the same call, on the event
loop's one thread. So every connection can land in the same buffer: 16 KiB per process, not per
connection (16 KB of the 49 KB an idle connection held, ``tests.bench.connection_memory``).

Neither asyncio nor ``ssl`` offers a supported way to size or share that buffer, so this patches
``asyncio.sslproto.SSLProtocol``, a private API, on the Python versions it was verified on only
(``VERIFIED_PYTHONS``); any other keeps asyncio's buffers, with a warning.
``tests/unit/test_tls_read_buffer.py`` fails when the running Python is not one of them, or when the
attributes the patch relies on change.
"""

import asyncio.sslproto
import functools
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

TLS_READ_BUFFER_BYTES = 16 * 1024
# (major, minor) of the Pythons whose ``SSLProtocol.__init__`` allocates ``_ssl_buffer`` and
# ``_ssl_buffer_view`` of ``max_size`` bytes, and whose selector transport receives into that view and
# hands it to ``buffer_updated`` in one call: where the shared buffer was measured and tested.
VERIFIED_PYTHONS = frozenset({(3, 11), (3, 12), (3, 13)})


def share_tls_read_buffer() -> bool:
    """Makes every TLS connection this process opens or accepts from now on read into one buffer of
    ``TLS_READ_BUFFER_BYTES``, shared by all of them. For the selector event loop (Linux's), whose
    transports fill the buffer and hand it to the protocol in one call; idempotent.

    Returns:
      Whether the buffer is shared: False on a Python outside ``VERIFIED_PYTHONS``, where every
      connection keeps asyncio's own buffer (logged).
    """
    python = sys.version_info[:2]
    if python not in VERIFIED_PYTHONS:
        verified = ", ".join(f"{major}.{minor}" for major, minor in sorted(VERIFIED_PYTHONS))
        log.warning(
            "Python %d.%d: each TLS connection keeps asyncio's own read buffer (sharing is verified on %s)",
            *python,
            verified,
        )
        return False
    protocol = asyncio.sslproto.SSLProtocol
    if getattr(protocol.__init__, "shares_read_buffer", False):
        return True
    protocol.max_size = TLS_READ_BUFFER_BYTES
    buffer = bytearray(TLS_READ_BUFFER_BYTES)
    view = memoryview(buffer)
    init = protocol.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # Any: the private fields are not in the stubs
        init(self, *args, **kwargs)
        self._ssl_buffer, self._ssl_buffer_view = buffer, view  # what ``get_buffer`` and ``buffer_updated`` use

    __init__.shares_read_buffer = True  # type: ignore[attr-defined]  # the mark the guard tests look for
    protocol.__init__ = __init__  # type: ignore[method-assign]  # the patch itself (see the module docstring)
    return True
