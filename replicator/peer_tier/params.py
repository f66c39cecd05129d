"""The peer routes' path parameters, parsed where both the grant check and the handlers need them."""

from aiohttp import web

from replicator.wire.http_errors import error_response


def int_param(request: web.Request, name: str) -> int:
    """The path parameter ``name`` as a non-negative integer (ASCII digits only: ``'٣'`` is not one here).

    Raises:
      HTTPBadRequest: it is not one.
    """
    value = request.match_info[name]
    if not (value.isascii() and value.isdigit()):
        raise error_response(web.HTTPBadRequest, f"{name} {value!r} is not a non-negative integer")
    return int(value)
