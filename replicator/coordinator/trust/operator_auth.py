"""Operators act with their own Kubernetes identity (``mtc coordinator --operator-identity``, with ``--kube``).

The operators' routes take, as their bearer token, the operator's own Kubernetes credential (the token of their
kubeconfig, or of its exec plugin: ``mtc status`` and ``mtc restore-from`` send it), never the cluster token that
every agent pod holds. The coordinator asks the API server who it is (a ``TokenReview`` with the API server's own
audiences), then whether that user may act (a ``SubjectAccessReview``) on a resource of our API group ``mtc.dev``
that exists only for RBAC, in the job's namespace:

====================================  =================================  ==========================================
route                                 asks                               ``kubectl auth can-i``
====================================  =================================  ==========================================
``POST .../restore-from`` (roll back)  ``create rollbacks`` named JOB     ``create rollbacks.mtc.dev/JOB -n NS``
``DELETE .../restore-from`` (cancel)   ``delete rollbacks`` named JOB     ``delete rollbacks.mtc.dev/JOB -n NS``
``GET .../restore-from`` (preview)     ``get checkpoints`` named JOB      ``get checkpoints.mtc.dev/JOB -n NS``
``GET /v1/status?job=...``             ``get checkpoints`` named JOB      as the preview
``GET /v1/status``                     ``get checkpoints`` in each NS     ``get checkpoints.mtc.dev -n NS``
====================================  =================================  ==========================================

So RBAC decides who may roll back which namespace: ``manifests/operator-rbac.yaml`` (and the chart) ship ClusterRoles
``mtc-checkpoint-viewer`` and ``mtc-rollback`` to bind. Status shows a caller only the jobs of the namespaces it may
read; the cluster's node lists only to a caller allowed cluster-wide (``get checkpoints`` with no namespace).

No token, or one the API server does not authenticate (the cluster token among them): 401. Authenticated but not
allowed: 403. The API server cannot be asked: 503. Each refusal is logged and counted in
``mtc_coordinator_operator_refusals_total{reason}``; each rollback and cancel is logged with its operator.

Without operator identity (``TokenOperators``) the routes that change state take the cluster token and the rest
stay open, as before: not defended (docs/security.md).
"""

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from aiohttp import web
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview
from prometheus_client import Counter

from replicator.wire.bearer import Tokens
from replicator.wire.http_errors import error_response
from replicator.wire.messages import JobRef
from replicator.wire.operator import ClusterStatus

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

API_GROUP = "mtc.dev"
"""The API group of the resources that exist for RBAC only: binding them needs no CRD, but ``kubectl auth can-i``
asks about them only once they are served, so ``manifests/operator-rbac.yaml`` has CRDs that refuse every object."""
# SubjectAccessReviews in flight at once for one status listing (one per namespace with jobs).
MAX_CONCURRENT_REVIEWS = 16
REFUSALS = Counter(
    "mtc_coordinator_operator_refusals_total",
    "Operators' requests refused: unauthenticated (401) or forbidden by RBAC (403)",
    ["reason"],
)


@dataclasses.dataclass(frozen=True)
class Action:
    """What an operator's route does, as RBAC sees it: ``verb`` on ``resource``, of API group ``mtc.dev``.

    Attributes:
      changes_state: without operator identity, such a route takes the cluster token (the others stay open).
    """

    verb: str
    resource: str
    changes_state: bool

    def __str__(self) -> str:
        return f"{self.verb} {self.resource}.{API_GROUP}"


ROLL_BACK = Action("create", "rollbacks", changes_state=True)
CANCEL_ROLLBACK = Action("delete", "rollbacks", changes_state=True)
READ = Action("get", "checkpoints", changes_state=False)


@dataclasses.dataclass(frozen=True)
class Operator:
    """Who the API server says a token is (a ``TokenReview``'s user), as a ``SubjectAccessReview`` asks about it."""

    username: str
    uid: str | None
    groups: tuple[str, ...]
    extra: tuple[tuple[str, tuple[str, ...]], ...]


class NotAuthenticated(Exception):
    """The request carries no token the API server authenticates (a 401)."""


class ReviewUnavailable(Exception):
    """The API server could not be asked, or refused the coordinator's review (a 503)."""


class KubeApi(Protocol):
    """The part of lightkube's ``AsyncClient`` the reviews use."""

    async def create(self, obj: Any) -> Any: ...


class OperatorAuth:
    """Asks the API server who an operator is and what it may do; nothing is cached, so a revoked token or
    binding counts at once.

    Args:
      api: lightkube's ``AsyncClient`` (or the same method), allowed to create ``tokenreviews`` and
        ``subjectaccessreviews``.
      cluster_tokens: the cluster's shared tokens: refused at once, never sent to the API server to review.
    """

    def __init__(self, api: KubeApi, cluster_tokens: Tokens | None = None):
        self._api = api
        self._cluster_tokens = cluster_tokens
        self._reviews = asyncio.Semaphore(MAX_CONCURRENT_REVIEWS)

    async def authenticate(self, authorization: str | None) -> Operator:
        """The operator an ``Authorization`` header's bearer token is.

        Raises:
          NotAuthenticated: no bearer token, the cluster token, or one the API server does not authenticate.
          ReviewUnavailable: the API server could not be asked.
        """
        scheme, _, token = (authorization or "").partition(" ")
        if scheme != "Bearer" or not token:
            raise NotAuthenticated(
                "no bearer token: the operators' routes take your own Kubernetes credential (mtc sends your kubeconfig's)"
            )
        if self._cluster_tokens is not None and self._cluster_tokens.accepts(token):
            raise NotAuthenticated("the cluster token is not an operator's credential: send your own Kubernetes token")
        review = TokenReview(spec=TokenReviewSpec(token=token))  # no audiences: the API server's own
        status = (await self._create(review, "review the token")).status
        if status is None or not status.authenticated or status.user is None or not status.user.username:
            raise NotAuthenticated(f"the API server did not authenticate the token: {status and status.error}")
        user = status.user
        extra = tuple(sorted((key, tuple(values)) for key, values in (user.extra or {}).items()))
        return Operator(user.username, user.uid, tuple(user.groups or ()), extra)

    async def allowed(self, operator: Operator, action: Action, namespace: str | None, name: str | None) -> bool:
        """Whether RBAC lets ``operator`` do ``action`` on the resource ``name`` (None: any) in ``namespace``
        (None: in every namespace, which only a cluster-wide grant allows).

        Raises:
          ReviewUnavailable: the API server could not be asked.
        """
        attributes = ResourceAttributes(
            group=API_GROUP, resource=action.resource, verb=action.verb, namespace=namespace, name=name
        )
        review = SubjectAccessReview(
            spec=SubjectAccessReviewSpec(
                user=operator.username,
                uid=operator.uid,
                groups=list(operator.groups),
                extra={key: list(values) for key, values in operator.extra},
                resourceAttributes=attributes,
            )
        )
        async with self._reviews:
            status = (await self._create(review, f"ask whether {operator.username} may {action}")).status
        return bool(status is not None and status.allowed and not status.denied)

    async def _create(self, review: Any, what: str) -> Any:
        try:
            return await self._api.create(review)
        except Exception as err:  # ApiError (our own RBAC refused), or the transport's
            log.error("cannot %s with the API server: %r", what, err)
            raise ReviewUnavailable(f"the coordinator cannot {what} with the API server: {err}") from None


def _forbidden(operator: Operator, action: Action, namespace: str, name: str | None) -> web.HTTPException:
    REFUSALS.labels("forbidden").inc()
    what = f"{action.resource}.{API_GROUP}" + (f"/{name}" if name else "")
    log.warning("refused: %s may not %s %s in namespace %s", operator.username, action.verb, what, namespace)
    return error_response(
        web.HTTPForbidden,
        f"{operator.username} may not {action.verb} {what} in namespace {namespace} "
        f"(kubectl auth can-i {action.verb} {what} -n {namespace} --as {operator.username})",
        reason="forbidden",
    )


async def _operator(auth: OperatorAuth, request: web.Request) -> Operator:
    """The request's operator.

    Raises:
      HTTPUnauthorized, HTTPServiceUnavailable: as ``OperatorAuth.authenticate``.
    """
    try:
        return await auth.authenticate(request.headers.get("Authorization"))
    except NotAuthenticated as err:
        REFUSALS.labels("unauthenticated").inc()
        log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, err)
        raise error_response(
            web.HTTPUnauthorized, str(err), reason="unauthenticated", headers={"WWW-Authenticate": "Bearer"}
        ) from None
    except ReviewUnavailable as err:
        raise error_response(web.HTTPServiceUnavailable, str(err)) from None


class Reader:
    """What an authenticated operator may read of ``GET /v1/status``: the jobs of the namespaces RBAC lets it
    ``get checkpoints`` in (a job named in the request: that job), and the cluster's nodes only with a
    cluster-wide grant. ``readable``, then ``shown``."""

    def __init__(self, auth: OperatorAuth, operator: Operator):
        self._auth = auth
        self._operator = operator
        self._namespaces: tuple[str, ...] | None = None  # None: every namespace

    async def readable(
        self, keys: list[JobRef] | None, every: list[JobRef], named: JobRef | None
    ) -> list[JobRef] | None:
        """The jobs to show of ``keys`` (None: of ``every`` job), ``named`` being the one job the request named.

        Raises:
          HTTPForbidden: the request named one job, and the operator may not read it.
          HTTPNotFound: the request named jobs by a bare name, and the operator may read none of them.
          HTTPServiceUnavailable: the API server could not be asked.
        """
        try:
            if await self._auth.allowed(self._operator, READ, None, None):
                return keys
            if named is not None:
                if not await self._auth.allowed(self._operator, READ, named.namespace, named.job):
                    raise _forbidden(self._operator, READ, named.namespace, named.job)
                shown = [named]
            elif keys is not None:  # every job of a bare name: each asked with its name
                allowed = await asyncio.gather(
                    *(self._auth.allowed(self._operator, READ, key.namespace, key.job) for key in keys)
                )
                shown = [key for key, ok in zip(keys, allowed) if ok]
                if not shown:
                    raise error_response(web.HTTPNotFound, f"no job named {keys[0].job!r}")
            else:
                namespaces = sorted({key.namespace for key in every})
                allowed = await asyncio.gather(
                    *(self._auth.allowed(self._operator, READ, namespace, None) for namespace in namespaces)
                )
                readable = {namespace for namespace, ok in zip(namespaces, allowed) if ok}
                shown = [key for key in every if key.namespace in readable]
        except ReviewUnavailable as err:
            raise error_response(web.HTTPServiceUnavailable, str(err)) from None
        self._namespaces = tuple(sorted({key.namespace for key in shown}))
        return shown

    def shown(self, status: ClusterStatus) -> ClusterStatus:
        """``status`` as this operator may see it: without the cluster's nodes unless allowed cluster-wide."""
        if self._namespaces is None:
            return status
        return msgspec.structs.replace(status, nodes=(), silent_nodes=(), namespaces=self._namespaces)


READER_KEY = web.RequestKey("operator_reader", Reader)
"""Where ``Operators.reading`` leaves the request's ``Reader`` (absent without operator identity)."""


class Operators(Protocol):
    """How the operators' routes are guarded (``routes.add_routes``)."""

    def acting(self, handler: Handler, action: Action) -> Handler:
        """``handler`` of a route on one job (``{namespace}``, ``{job}``), doing ``action``."""
        ...

    def reading(self, handler: Handler) -> Handler:
        """``handler`` of ``GET /v1/status``, which narrows what it shows with the request's ``READER_KEY``."""
        ...


class KubeOperators:
    """Operator identity: every operators' route asks the API server (``OperatorAuth``)."""

    def __init__(self, auth: OperatorAuth):
        self._auth = auth

    def acting(self, handler: Handler, action: Action) -> Handler:
        auth = self._auth

        @functools.wraps(handler)
        async def checked(request: web.Request) -> web.StreamResponse:
            operator = await _operator(auth, request)
            namespace, job = request.match_info["namespace"], request.match_info["job"]
            try:
                allowed = await auth.allowed(operator, action, namespace, job)
            except ReviewUnavailable as err:
                raise error_response(web.HTTPServiceUnavailable, str(err)) from None
            if not allowed:
                raise _forbidden(operator, action, namespace, job)
            response = await handler(request)
            if action.changes_state:  # who rolled back what: the API server's audit log does not see it
                log.info(
                    "%s %s/%s: %s by %s (uid %s)",
                    request.method,
                    namespace,
                    job,
                    action,
                    operator.username,
                    operator.uid,
                )
            return response

        return checked

    def reading(self, handler: Handler) -> Handler:
        auth = self._auth

        @functools.wraps(handler)
        async def checked(request: web.Request) -> web.StreamResponse:
            request[READER_KEY] = Reader(auth, await _operator(auth, request))
            return await handler(request)

        return checked


class TokenOperators:
    """No operator identity: the routes that change state take ``guard`` (the cluster token's check, or none
    with ``--insecure``); the previews and status stay open."""

    def __init__(self, guard: Callable[[Handler], Handler]):
        self._guard = guard

    def acting(self, handler: Handler, action: Action) -> Handler:
        return self._guard(handler) if action.changes_state else handler

    def reading(self, handler: Handler) -> Handler:
        return handler
