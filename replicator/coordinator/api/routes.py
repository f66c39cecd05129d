"""The coordinator's HTTP API: its routes and their handlers.

Routes (JSON; errors are ``{"error": "..."}``):

- ``POST /v1/report``: a node agent's ``NodeReport``; answers a ``ReportReply``. A report whose
  ``waiting`` is set is held (long poll, up to ``MAX_WAIT_SECONDS``) until one of the node's waiting
  pods has its assignment. 409 names both versions when the agent's ``protocol`` is not ours.
- ``POST /v1/jobs/{namespace}/{job}/settings``: a ``SettingsRequest`` (``{"incarnation", "rank", "settings"}``).
- ``GET  /v1/jobs/{namespace}/{job}/restore?incarnation=I&rank=R[&seen=G&wait=S]``: a ``RestoreView``;
  with ``seen`` (``<generation>:<ready>`` of the view the rank has), held up to ``wait`` seconds
  until the view differs from it.
- ``POST /v1/jobs/{namespace}/{job}/restore``: a ``StagedReport`` (``{"incarnation", "generation", "rank", "source",
  "bad": [[step, rank, holder]], "retrying"}``): ``retrying`` when the rank will try unreachable sources again (no replan).
- ``POST /v1/jobs/{namespace}/{job}/restore-from``: a ``RestoreFrom`` (``{"step"}``); the next restore uses that step
  (a rollback); 409 when no tier holds it complete. ``GET ...?step=N`` previews it (a ``RollbackPreview``: the
  newer steps it abandons, per tier), changing nothing. ``DELETE`` cancels it until the restore is planned
  (409 after that, or when none is pending).
- ``GET  /v1/status[?job=NAMESPACE/JOB]``: a ``ClusterStatus`` (``job=NAME`` takes every job of that name);
  ``GET /healthz`` (a ``Health``: with ``--peer-grants``, the id of the key grants are signed with), ``GET /metrics``.

The operators' routes (``restore-from``, status) are guarded by ``operator_auth``: with operator identity, by the
caller's own Kubernetes identity and RBAC; else the rollback and its cancel by the cluster token, the rest open.

A job no node has reported is a 404.

Bodies are typed (``replicator.wire.messages``) and decoded here, at the edge: a body that does not
decode is answered 400 with an error naming the field. Acknowledgements are a ``Done``. What a handler
reads lives in the app under the ``*_KEY`` keys, set by ``service.make_app``.
"""

import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web
from lightkube import AsyncClient
from prometheus_client import CONTENT_TYPE_LATEST, Counter

from replicator.coordinator.api import cluster_gauges
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.job_changes import JobChanges
from replicator.coordinator.api.settings_snapshot import SettingsSnapshot
from replicator.coordinator.kube.kube_overlay import KubeOverlay
from replicator.coordinator.kube.node_notices import NoticeEvents
from replicator.coordinator.planning.rollbacks import NotCancellable
from replicator.coordinator.state import (
    ClusterState,
    NodeIdTaken,
    NotReady,
    UnknownIncarnation,
    UnknownJob,
)
from replicator.coordinator.trust import peer_grants, report_order
from replicator.coordinator.trust.node_identity import IdentityRefused, IdentityUnavailable, NodeVerifier
from replicator.coordinator.trust.operator_auth import CANCEL_ROLLBACK, READ, READER_KEY, ROLL_BACK, Operators
from replicator.coordinator.trust.report_order import ReportOrder, StaleReport
from replicator.wire.grants import GrantSigner
from replicator.wire.http_errors import error_response
from replicator.wire.messages import (
    MAX_WAIT_SECONDS,
    NODE_TOKEN_HEADER,
    REPORT_ORDER_HEADER,
    JobRef,
    NodeReport,
    ProtocolMismatch,
    ReportReply,
    SettingsRequest,
    StagedReport,
    Step,
    Versioned,
    check_version,
    decode,
    decode_json,
)
from replicator.wire.operator import Done, Health, RestoreFrom

log = logging.getLogger(__name__)

REPORT_BYTES = Counter("mtc_coordinator_report_bytes_total", "Bytes of report bodies received from node agents")

M = TypeVar("M")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Guard = Callable[[Handler], Handler]
STATE_KEY = web.AppKey("state", ClusterState)
CONFIG_KEY = web.AppKey("config", CoordinatorConfig)
CHANGES_KEY = web.AppKey("changes", JobChanges)
SNAPSHOT_KEY = web.AppKey("snapshot", SettingsSnapshot)
OVERLAY_KEY = web.AppKey("overlay", KubeOverlay)
ORDER_KEY = web.AppKey("report_order", ReportOrder)
KUBE_CLIENT_KEY = web.AppKey("kube_client", AsyncClient)
VERIFIER_KEY = web.AppKey("node_verifier", NodeVerifier)
SIGNER_KEY = web.AppKey("grant_signer", GrantSigner)
NOTICES_KEY = web.AppKey("notices", NoticeEvents)  # with --kube: the reports' notices as events (node_notices)

BadRequest = functools.partial(error_response, web.HTTPBadRequest)


async def _body(request: web.Request, kind: type[M]) -> M:
    """The request's JSON body as ``kind``, decoded in one pass.

    Raises:
      BadRequest: not JSON, or a field is missing, of the wrong type or out of bounds (named).
    """
    try:
        return decode_json(await request.read(), kind)
    except ValueError as err:
        raise BadRequest(f"bad {kind.__name__}: {err}") from None


# A TLS connection keeps room for the largest write it ever made: asyncio passes each write to OpenSSL
# through a memory buffer (``ssl.MemoryBIO``) that grows to hold that write's records and never shrinks.
# A restore view of 25 KB, written at once, left about 28 KB on each restoring node's connection for as
# long as it stayed open. Larger bodies go out in pieces of this size.
WRITE_PIECE_BYTES = 4 * 1024


async def _reply(request: web.Request, message: object) -> web.StreamResponse:
    """``message`` as the JSON response to ``request``, written in pieces of at most ``WRITE_PIECE_BYTES``."""
    body = msgspec.json.encode(message)
    if len(body) <= WRITE_PIECE_BYTES:
        return web.Response(body=body, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    await response.prepare(request)
    pieces = memoryview(body)
    for start in range(0, len(body), WRITE_PIECE_BYTES):
        await response.write(pieces[start : start + WRITE_PIECE_BYTES])
    await response.write_eof()
    return response


# A restore request the plan is not ready for is looked at again this often while it is held.
NOT_READY_RECHECK_SECONDS = 1.0


def _job_key(request: web.Request) -> JobRef:
    return JobRef(request.match_info["namespace"], request.match_info["job"])


def _not_found(err: Exception) -> web.HTTPException:
    return error_response(web.HTTPNotFound, str(err))


def _conflict(err: Exception) -> web.HTTPException:
    return error_response(web.HTTPConflict, str(err))


def _decode_report(body: bytes) -> NodeReport:
    """The report in ``body``, of our protocol version.

    Raises:
      ProtocolMismatch: the agent speaks another version (even if its report does not decode).
      ValueError: the report does not decode; the message names the field.
    """
    try:
        report = decode_json(body, NodeReport)
    except ValueError:
        try:
            theirs = decode_json(body, Versioned).protocol
        except ValueError:
            raise ValueError("the report is not a JSON object with a protocol version") from None
        check_version(theirs, "the node agent")
        raise
    check_version(report.protocol, f"node agent {report.node_id}")
    return report


async def post_report(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    REPORT_BYTES.inc(len(body))
    try:
        report = _decode_report(body)
    except ProtocolMismatch as err:
        log.error("refused a report from %s: %s", request.remote, err)
        raise _conflict(err) from None
    except ValueError as err:
        raise BadRequest(str(err)) from None
    try:
        order = report_order.parse(request.headers.get(REPORT_ORDER_HEADER))
    except ValueError as err:
        raise BadRequest(f"{REPORT_ORDER_HEADER}: {err}") from None
    max_nodes = request.app[CONFIG_KEY].max_nodes
    for index, pod in enumerate(report.pods):
        if pod.nodes > max_nodes or pod.slices > pod.nodes:
            raise BadRequest(
                f"pods[{index}]: nodes={pod.nodes} must be at most {max_nodes} and slices={pod.slices} at most nodes"
            )
    state, changes, overlay = request.app[STATE_KEY], request.app[CHANGES_KEY], request.app.get(OVERLAY_KEY)
    if (verifier := request.app.get(VERIFIER_KEY)) is not None:
        await _prove_node(verifier, state, report.node_id, request)
    seen = overlay.version if overlay else 0
    try:
        request.app[ORDER_KEY].admit(report.node_id, order)
    except StaleReport as err:
        log.warning("refused a report from %s: %s", request.remote, err)
        raise _conflict(err) from None
    reply = _take_report(state, overlay, report, request.remote)
    if report.notices and overlay is not None:  # after the node's proof and its admission
        request.app[NOTICES_KEY].take(report, overlay.shapes)
    changes.publish()
    deadline = time.monotonic() + MAX_WAIT_SECONDS
    # Long poll: held while a pod waits for its assignment. The agent cancels it (the handler is
    # cancelled with the connection) when it has something new to report.
    while report.waiting and time.monotonic() < deadline:
        assigned = {a.pod_uid for a in reply.assignments}
        waiting = {
            JobRef(p.namespace, p.job) for p in report.pods if p.incarnation is None and p.pod_uid not in assigned
        }
        if not waiting:
            break
        await changes.wait(waiting, min(deadline - time.monotonic(), state.heartbeat_seconds))
        if overlay and overlay.version != seen:  # the API server placed (or moved) pods: the report again
            seen = overlay.version
            if not request.app[ORDER_KEY].is_newest(report.node_id, order):
                break  # the node has reported since: this held report is not its state any more
            reply = _take_report(state, overlay, report, request.remote)
            changes.publish()
            continue
        state.touch(report.node_id, time.time())
        reply = state.reply_for(report.node_id)
    if (signer := request.app.get(SIGNER_KEY)) is not None:
        reply = peer_grants.with_push_grants(reply, signer, report.node_id)
    return await _reply(request, reply)


async def _prove_node(verifier: NodeVerifier, state: ClusterState, node_id: str, request: web.Request) -> None:
    """Admits the report only from an agent that proves it runs on ``node_id``; a node recreated under
    that name (another UID) replaces the old one, whose pods and copies are forgotten at once.

    Raises:
      HTTPForbidden: not proven; the JSON body's ``reason`` is one of ``node_identity.REASONS``.
      HTTPServiceUnavailable: the API server could not be asked (the agent retries).
    """
    try:
        admission = await verifier.admit(request.headers.get(NODE_TOKEN_HEADER), node_id)
    except IdentityRefused as err:
        log.warning(
            "refused %s %s for node %s from %s (%s): %s",
            request.method,
            request.path,
            node_id,
            request.remote,
            err.reason,
            err,
        )
        raise error_response(web.HTTPForbidden, str(err), reason=err.reason) from None
    except IdentityUnavailable as err:
        log.error("cannot check the identity of node %s: %s", node_id, err)
        raise error_response(web.HTTPServiceUnavailable, str(err)) from None
    if admission.replaced:
        state.forget_node(node_id)


def _take_report(
    state: ClusterState, overlay: KubeOverlay | None, report: NodeReport, remote: str | None
) -> ReportReply:
    """The state's reply to ``report``, laid under the API server's shapes when the coordinator reads them.

    Raises:
      HTTPConflict: the node id is taken by a live node at another URL.
    """
    try:
        return state.apply_report(overlay.apply(report) if overlay else report, time.time())
    except NodeIdTaken as err:
        log.warning("refused a report from %s: %s", remote, err)
        raise _conflict(err) from None


async def _prove_rank(request: web.Request, key: JobRef, incarnation: str, rank: int) -> str:
    """The node ``rank`` of the incarnation runs on; with per-node identity, only an agent proving that node may
    speak for the rank (its settings, its restore view and the grants in it, its staging result).

    Raises:
      HTTPNotFound: the incarnation or rank is not current.
      HTTPForbidden, HTTPServiceUnavailable: as ``_prove_node``.
    """
    state = request.app[STATE_KEY]
    try:
        node = state.restore.node_of_rank(key, incarnation, rank)
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    if (verifier := request.app.get(VERIFIER_KEY)) is not None:
        await _prove_node(verifier, state, node, request)
    return node


async def post_settings(request: web.Request) -> web.StreamResponse:
    body = await _body(request, SettingsRequest)
    await _prove_rank(request, _job_key(request), body.incarnation, body.rank)
    try:
        request.app[STATE_KEY].restore.settings(_job_key(request), body.incarnation, body.rank, body.settings)
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    request.app[SNAPSHOT_KEY].due = True
    return await _reply(request, Done(True))


async def get_restore(request: web.Request) -> web.StreamResponse:
    try:
        incarnation, rank = request.query["incarnation"], int(request.query["rank"])
        wait = min(float(request.query.get("wait", 0)), MAX_WAIT_SECONDS)
    except (KeyError, ValueError) as err:
        raise BadRequest(f"incarnation and rank query parameters are required, wait is seconds: {err}") from None
    key, seen = _job_key(request), request.query.get("seen")
    state, changes = request.app[STATE_KEY], request.app[CHANGES_KEY]
    deadline = time.monotonic() + wait
    signer = request.app.get(SIGNER_KEY)
    # The view grants its sources to the rank's node: with per-node identity, it goes only to an agent there.
    node = await _prove_rank(request, key, incarnation, rank)
    with contextlib.suppress(UnknownIncarnation):  # answered below
        state.restore.touch_rank(key, incarnation, rank, time.time())  # when it asks: a killed agent's poll may linger
    while True:
        try:
            view = state.restore.view(key, incarnation, rank, time.time())
        except UnknownIncarnation as err:
            raise _not_found(err) from None
        except NotReady as err:
            # Held here, not retried by the agent: N ranks asking at once must not become N
            # requests a second while the plan waits for reports.
            if time.monotonic() >= deadline:
                raise error_response(web.HTTPServiceUnavailable, str(err)) from None
            await changes.wait([key], min(deadline - time.monotonic(), NOT_READY_RECHECK_SECONDS))
            continue
        changes.publish()
        if seen != view.token or time.monotonic() >= deadline:
            return await _reply(
                request, view if signer is None else peer_grants.with_fetch_grants(view, signer, key, node)
            )
        # Not held while waiting: a view carries its sources' checksums unpacked (about 15 KB a
        # listed copy), and every rank of a restoring job long-polls at once.
        del view
        await changes.wait([key], deadline - time.monotonic())


async def post_restore(request: web.Request) -> web.StreamResponse:
    body = await _body(request, StagedReport)
    await _prove_rank(request, _job_key(request), body.incarnation, body.rank)
    try:
        request.app[STATE_KEY].restore.staged(
            _job_key(request), body.incarnation, body.generation, body.rank, body.source, body.bad, body.retrying
        )
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    request.app[CHANGES_KEY].publish()
    return await _reply(request, Done(True))


async def post_restore_from(request: web.Request) -> web.StreamResponse:
    body = await _body(request, RestoreFrom)
    try:
        request.app[STATE_KEY].operator.force(_job_key(request), body.step)
    except UnknownJob as err:
        raise _not_found(err) from None
    except LookupError as err:
        raise _conflict(err) from None
    return await _reply(request, Done(True, body.step))


async def get_restore_from(request: web.Request) -> web.StreamResponse:
    try:
        step = decode(int(request.query["step"]), Step)
    except (KeyError, ValueError) as err:
        raise BadRequest(f"the step query parameter must be a step number: {err}") from None
    try:
        return await _reply(request, request.app[STATE_KEY].operator.preview(_job_key(request), step))
    except UnknownJob as err:
        raise _not_found(err) from None
    except LookupError as err:
        raise _conflict(err) from None


async def delete_restore_from(request: web.Request) -> web.StreamResponse:
    try:
        step = request.app[STATE_KEY].operator.cancel(_job_key(request))
    except UnknownJob as err:
        raise _not_found(err) from None
    except NotCancellable as err:
        raise _conflict(err) from None
    return await _reply(request, Done(True, step))


def _status_keys(state: ClusterState, job: str | None) -> list[JobRef] | None:
    """The jobs ``?job=`` names: ``NAMESPACE/JOB``, or every job of a bare name (as before).

    Raises:
      BadRequest: a malformed name; HTTPNotFound: no such job.
    """
    if job is None:
        return None
    if "/" not in job:
        keys = [k for k in state.job_keys() if k.job == job]
        if not keys:
            raise error_response(web.HTTPNotFound, f"no job named {job!r}")
        return keys
    try:
        return [JobRef.parse(job)]
    except ValueError as err:
        raise BadRequest(f"job: {err}") from None


async def get_status(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.tick(time.time())
    job = request.query.get("job")
    keys = _status_keys(state, job)
    if (reader := request.get(READER_KEY)) is not None:  # operator identity: what the caller may read
        named = keys[0] if keys is not None and "/" in (job or "") else None
        keys = await reader.readable(keys, state.job_keys(), named)
    try:
        status = state.operator.status(keys)
    except UnknownJob as err:
        raise _not_found(err) from None
    return await _reply(request, reader.shown(status) if reader is not None else status)


async def healthz(request: web.Request) -> web.StreamResponse:
    signer = request.app.get(SIGNER_KEY)
    return await _reply(request, Health(True, signer.key_id if signer is not None else None))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.tick(time.time())
    return web.Response(body=cluster_gauges.exposition(state), headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application, guard: Guard, operators: Operators) -> None:
    """Adds every route to ``app``; ``guard`` wraps the agents' handlers (the cluster token's check),
    ``operators`` the operators' (``operator_auth``). Health and metrics stay open."""
    app.add_routes(
        [
            web.post("/v1/report", guard(post_report)),
            web.post("/v1/jobs/{namespace}/{job}/settings", guard(post_settings)),
            web.get("/v1/jobs/{namespace}/{job}/restore", guard(get_restore)),
            web.post("/v1/jobs/{namespace}/{job}/restore", guard(post_restore)),
            web.post("/v1/jobs/{namespace}/{job}/restore-from", operators.acting(post_restore_from, ROLL_BACK)),
            web.get("/v1/jobs/{namespace}/{job}/restore-from", operators.acting(get_restore_from, READ)),
            web.delete(
                "/v1/jobs/{namespace}/{job}/restore-from", operators.acting(delete_restore_from, CANCEL_ROLLBACK)
            ),
            web.get("/v1/status", operators.reading(get_status)),
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
        ]
    )
