"""The peer service's check of the coordinator's grants (``mtc node --peer-grants``; ``replicator.wire.grants``).

Every peer route then needs, besides the cluster token, a grant for exactly the copy its path names, made out to
this node: a fetch's grant reads the manifest and the files, a push's writes the files, commits them and reads the
manifest back. Listing a job's steps needs a grant the coordinator never issues: it is refused. A refusal is 403
with a JSON ``error`` and ``reason``, counted in ``mtc_peer_grant_refusals_total{reason}``, and logged.
"""

import dataclasses
import functools
import logging
import time
from typing import NoReturn

from aiohttp import web
from prometheus_client import Counter

from replicator.peer_tier.params import int_param
from replicator.wire.bearer import Handler
from replicator.wire.grants import GRANT_HEADER, GrantKeys, GrantRefused, Operation
from replicator.wire.http_errors import error_response

log = logging.getLogger(__name__)

REFUSALS = Counter(
    "mtc_peer_grant_refusals_total", "Peer requests refused for their grant (--peer-grants), by reason", ["reason"]
)


@dataclasses.dataclass(frozen=True)
class PeerGrants:
    """What the check needs: the coordinator's keys as the report loop learns them, and this node's id."""

    keys: GrantKeys
    node_id: str


def require_grant(handler: Handler, allowed: tuple[Operation, ...], grants: PeerGrants) -> Handler:
    """Wraps a handler of a route under ``.../ranks/{rank}/steps/{step}`` so that it runs only for a request whose
    grant allows one of ``allowed`` on that copy at this node; others get 403 before the handler reads anything."""

    @functools.wraps(handler)
    async def checked(request: web.Request) -> web.StreamResponse:
        info = request.match_info
        try:
            grants.keys.check(
                request.headers.get(GRANT_HEADER, ""),
                allowed=allowed,
                namespace=info["namespace"],
                job=info["job"],
                rank=int_param(request, "rank"),
                step=int_param(request, "step"),
                node=grants.node_id,
                now=time.time(),
            )
        except GrantRefused as refused:
            _refuse(request, refused)
        return await handler(request)

    return checked


def refuse_listing(handler: Handler) -> Handler:
    """Wraps the steps listing: with grants on, nobody may list (no grant names a listing)."""

    @functools.wraps(handler)
    async def refused(request: web.Request) -> web.StreamResponse:
        _refuse(request, GrantRefused("no listing", "with --peer-grants this node lists its steps to nobody"))

    return refused


def _refuse(request: web.Request, refused: GrantRefused) -> NoReturn:
    REFUSALS.labels(refused.reason).inc()
    log.warning("refused a peer request %s %s from %s: %s", request.method, request.path, request.remote, refused)
    raise error_response(web.HTTPForbidden, str(refused), reason=refused.reason)
