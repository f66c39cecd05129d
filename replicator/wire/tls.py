"""The TLS contexts of both processes: serving HTTPS, and checking a server against a CA bundle.

``mtc node`` serves its HTTP side with ``--peer-tls-cert``/``--peer-tls-key`` and checks peers and
the coordinator against ``--peer-tls-ca``/``--coordinator-ca``; ``mtc coordinator`` serves with
``--tls-cert``/``--tls-key``; ``mtc status`` and ``mtc restore-from`` check it with ``--ca``.
"""

import ssl


def check_pair(cert: str | None, key: str | None, flags: str) -> None:
    """Checks that a certificate and its key are given together (or neither).

    Args:
      flags: the two flags, named in the error, e.g. ``"--tls-cert and --tls-key"``.

    Raises:
      ValueError: only one of them is given.
    """
    if (cert is None) != (key is None):
        raise ValueError(f"{flags} go together")


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The context to serve HTTPS with ``cert`` and ``key`` (PEM files), or None for plain HTTP (no cert).

    Raises:
      OSError, ssl.SSLError: the certificate or key cannot be loaded.
    """
    if cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def client_context(ca_file: str | None) -> ssl.SSLContext | None:
    """The context that checks servers against ``ca_file`` (PEM), or None for the caller's default
    (aiohttp's and urllib's: the system's CAs)."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else None
