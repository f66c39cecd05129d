"""The one port allocator of the tests, the chaos runner and the benches."""

import itertools
import os
import socket
import threading

# Below Linux's ephemeral range (32768-60999), so no outgoing connection is ever given one of them.
_LOW, _HIGH = 15000, 32768
_BLOCK = 200
# Each process starts in its own block (by pid), so concurrent runs rarely meet; the bind check
# below skips a port another process holds when they do.
_offsets = itertools.count((os.getpid() % ((_HIGH - _LOW) // _BLOCK)) * _BLOCK)
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to at ``host`` (``0.0.0.0``: at any address, as JAX's coordinator binds),
    never the same one twice in this process.

    Raises:
      RuntimeError: every port of the range is taken.
    """
    with _lock:
        for _ in range(_HIGH - _LOW):
            port = _LOW + next(_offsets) % (_HIGH - _LOW)
            with socket.socket() as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{_HIGH - 1} on {host}")


def listen_address(host: str = "127.0.0.1") -> str:
    """``HOST:PORT`` with a free port: what ``LocalCluster`` and ``NodeAgentProcess`` listen on."""
    return f"{host}:{free_port(host)}"
