"""The cluster's shared bearer tokens: what the peer service and the coordinator require of callers.

A token file (a mounted Kubernetes Secret) holds one token per line. The first is the one a caller
sends; every line is accepted. That makes rotation possible without a restart: add the new token as a
second line everywhere, then make it the first, then remove the old one (``docs/upgrading.md``). The
kubelet rewrites a mounted Secret by swapping a symlink, at a different moment on each node, so every
``Tokens`` checks its file on use (one ``stat``) and reads it again when it changed.
"""

import functools
import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web

from replicator.wire.http_errors import error_response

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_tokens(text: str, source: str) -> tuple[str, ...]:
    """The tokens of a token file's ``text``: one per line, blank lines and surrounding white space left out.

    Raises:
      ValueError: none, or one holding white space or a character a header cannot carry (named by ``source``).
    """
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not tokens:
        raise ValueError(f"token file {source} is empty")
    for number, token in enumerate(tokens, 1):
        if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
            raise ValueError(
                f"token file {source}: token {number} holds white space or a character other than printable ASCII"
            )
    return tokens


def _stamp(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size


class Tokens:
    """The tokens of a token file, read again when the file changes (another inode, mtime or size).

    Thread-safe. A file that cannot be read or parsed after it changed keeps the tokens last read
    (logged once per change): a half-done edit never locks the cluster out.

    Raises (constructor):
      OSError: the file cannot be read.
      ValueError: it holds no token, or a malformed one (``parse_tokens``).
    """

    def __init__(self, path: str | None, tokens: tuple[str, ...] = ()):
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int, int] | None = None
        self._failed: tuple[int, int, int, int] | None = None  # the stamp whose read failed (logged once)
        if path is None:
            self._tokens = parse_tokens("\n".join(tokens), "(given)")
        else:
            with open(path, "rb") as f:
                self._stamp = _stamp(os.fstat(f.fileno()))
                self._tokens = parse_tokens(f.read().decode("utf-8"), path)

    @classmethod
    def of(cls, *tokens: str) -> "Tokens":
        """Fixed tokens, not from a file (the first is sent).

        Raises:
          ValueError: none given, or a malformed one.
        """
        return cls(None, tokens)

    def _refresh(self) -> tuple[str, ...]:
        if self.path is None:
            return self._tokens
        try:
            stamp = _stamp(os.stat(self.path))
        except OSError:
            stamp = None  # gone for a moment (a swap in progress): keep the tokens last read
        if stamp is None or stamp == self._stamp or stamp == self._failed:
            return self._tokens
        with self._lock:
            if stamp == self._stamp:
                return self._tokens
            try:
                with open(self.path, "rb") as f:
                    stamp = _stamp(os.fstat(f.fileno()))
                    tokens = parse_tokens(f.read().decode("utf-8"), self.path)
            except (OSError, ValueError) as err:
                self._failed = stamp
                log.error(
                    "token file %s changed but cannot be used, keeping its previous %d token(s): %s",
                    self.path,
                    len(self._tokens),
                    err,
                )
                return self._tokens
            if tokens != self._tokens:
                log.info("token file %s changed: %d token(s), the first is sent", self.path, len(tokens))
            self._tokens, self._stamp, self._failed = tokens, stamp, None
            return tokens

    @property
    def current(self) -> str:
        """The token to send: the file's first."""
        return self._refresh()[0]

    def accepts(self, given: str) -> bool:
        """Whether ``given`` is one of the file's tokens; takes the same time wherever it matches."""
        encoded = given.encode("utf-8", "surrogateescape")
        matches = [hmac.compare_digest(encoded, token.encode()) for token in self._refresh()]
        return any(matches)

    def header(self) -> dict[str, str]:
        """The request header that presents the current token."""
        return auth_header(self.current)


def read_token(path: str) -> str:
    """The token to send from a token file (its first line), for a command that runs once.

    Raises:
      OSError: it cannot be read.
      ValueError: it holds no token, or a malformed one.
    """
    return Tokens(path).current


def auth_header(token: str) -> dict[str, str]:
    """The request header that presents ``token``."""
    return {"Authorization": f"Bearer {token}"}


def require_bearer(handler: Handler, tokens: Tokens) -> Handler:
    """Wraps ``handler`` so that it runs only for a request bearing one of ``tokens``; others get 401
    before anything of the request is parsed. The comparison takes constant time."""

    @functools.wraps(handler)
    async def checked(request: web.Request) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not tokens.accepts(given):
            raise error_response(
                web.HTTPUnauthorized, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        return await handler(request)

    return checked
