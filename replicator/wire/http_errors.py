"""The JSON error body of both HTTP services (the coordinator, the peer service), and its reading.

An error answers ``{"error": "<message>"}``, with ``"problems": [...]`` when there is a list of them
(a pushed replica that fails its checksums) and ``"reason": "<word>"`` when a program tells refusals
apart (a node identity refused: ``replicator.coordinator.trust.node_identity.REASONS``). Clients read it back with ``error_of``.
"""

import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web


def error_response(
    kind: type[web.HTTPException],
    message: str,
    problems: Sequence[str] = (),
    reason: str | None = None,
    **kwargs: Any,
) -> web.HTTPException:
    """The HTTP error ``kind`` (e.g. ``web.HTTPNotFound``) to raise, with the JSON error body.

    Args:
      message: the body's ``error``.
      problems: the body's ``problems``, left out when empty.
      reason: the body's ``reason``, a short word a program can tell refusals apart by; left out when None.
      kwargs: for ``kind`` (e.g. ``headers``).
    """
    body: dict[str, Any] = {"error": message}
    if problems:
        body["problems"] = list(problems)
    if reason is not None:
        body["reason"] = reason
    return kind(text=json.dumps(body), content_type="application/json", **kwargs)


def error_of(raw: bytes | str, limit: int = 500) -> str:
    """The message of an error body: its ``error``, then ``; <problem>`` for each of its problems.
    A body that is not one (a proxy's page, a truncated body) gives its first ``limit`` characters."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        body = json.loads(text)
        return str(body["error"]) + "".join(f"; {problem}" for problem in body.get("problems", ()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return text[:limit]
