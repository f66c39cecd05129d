"""The cluster's shared bearer token: what the peer service and the coordinator require of callers."""

import functools
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from replicator.wire.http_errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_token(path: str) -> str:
    """Reads a token file (a mounted Kubernetes Secret), without surrounding white space.

    Raises:
      OSError: it cannot be read.
      ValueError: it is empty.
    """
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def auth_header(token: str) -> dict[str, str]:
    """The request header that presents ``token``."""
    return {"Authorization": f"Bearer {token}"}


def require_bearer(handler: Handler, token: str) -> Handler:
    """Wraps ``handler`` so that it runs only for a request bearing ``token``; others get 401
    before anything of the request is parsed. The comparison takes constant time.

    Raises:
      ValueError: ``token`` is empty.
    """
    if not token:
        raise ValueError("the bearer token must not be empty")
    expected = f"Bearer {token}".encode()

    @functools.wraps(handler)
    async def checked(request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            raise error_response(web.HTTPUnauthorized, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return checked
