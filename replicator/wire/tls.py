"""The TLS contexts of both processes: serving HTTPS, and checking a server against a CA bundle.

``mtc node`` serves its HTTP side with ``--peer-tls-cert``/``--peer-tls-key`` and checks peers and
the coordinator against ``--peer-tls-ca``/``--coordinator-ca`` (peers, with ``--peer-tls-check ca``,
against the CA alone: ``ServerCheck``); ``mtc coordinator`` serves with
``--tls-cert``/``--tls-key``; ``mtc status`` and ``mtc restore-from`` check it with ``--ca``, and
with ``--tls-server-name`` against another name than the URL's host (``server_name_opener``).
"""

import enum
import functools
import http.client
import ssl
import urllib.request
from typing import Any


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


class ServerCheck(enum.StrEnum):
    """What a client checks of a server's certificate, beyond its chain to the CA bundle."""

    NAME = "name"  # it also names the host connected to: each server holds a certificate of its own
    # The chain alone: servers share one certificate that cannot name them all (the chart's peer
    # certificate, made before any pod has an address). It proves "holds a key of this CA", not which server.
    CA = "ca"


def client_context(ca_file: str | None, check: ServerCheck = ServerCheck.NAME) -> ssl.SSLContext | None:
    """The context that checks servers against ``ca_file`` (PEM), or None for the caller's default
    (aiohttp's and urllib's: the system's CAs, and the name).

    Args:
      check: ``ServerCheck.CA`` accepts any certificate that chains to ``ca_file``, whatever host it names.

    Raises:
      ValueError: ``ServerCheck.CA`` without ``ca_file`` (any certificate of a public CA would pass).
      OSError, ssl.SSLError: ``ca_file`` cannot be read.
    """
    if check is ServerCheck.CA:
        if not ca_file:
            raise ValueError("checking the CA alone needs a CA bundle of its own")
        context = ssl.create_default_context(cafile=ca_file)
        context.check_hostname = False  # verify_mode stays CERT_REQUIRED: the chain is still checked
        return context
    return ssl.create_default_context(cafile=ca_file) if ca_file else None


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection to its host that sends ``server_name`` (SNI) and checks the certificate
    against it: what ``kubectl --tls-server-name`` does through a port-forward."""

    def __init__(self, host: str, *, server_name: str, context: ssl.SSLContext, **kwargs: Any):
        super().__init__(host, context=context, **kwargs)
        self._server_name, self._tls = server_name, context

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP to the URL's host; no proxy tunnel
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self._server_name)


class _ServerNameHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext, server_name: str):
        super().__init__(context=context)
        self._connection = functools.partial(_NamedHTTPSConnection, server_name=server_name, context=context)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)


def opener(ca_file: str | None, server_name: str | None = None) -> urllib.request.OpenerDirector:
    """A urllib opener that checks an https:// server against ``ca_file`` (PEM; else the system's
    CAs) and, with ``server_name``, against that name instead of the URL's host (e.g. the in-cluster
    name of a coordinator reached at ``https://127.0.0.1:8471`` through ``kubectl port-forward``;
    no proxy is used then).

    Raises:
      OSError, ssl.SSLError: ``ca_file`` cannot be read.
    """
    context = ssl.create_default_context(cafile=ca_file)
    if server_name is None:
        return urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
    # No proxy: the connection goes to the URL's host itself (a port-forward is local).
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _ServerNameHandler(context, server_name))
