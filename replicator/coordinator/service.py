"""``mtc coordinator``: one small aiohttp service per cluster, holding soft state only.

Routes (JSON; errors are ``{"error": "..."}``):

- ``POST /v1/report``: a node agent's ``NodeReport``; answers a ``ReportReply``.
- ``POST /v1/jobs/{namespace}/{job}/settings``: ``{"incarnation", "rank", "settings"}``.
- ``GET  /v1/jobs/{namespace}/{job}/restore?incarnation=I&rank=R``: a ``RestoreView``.
- ``POST /v1/jobs/{namespace}/{job}/restore``: ``{"incarnation", "generation", "rank", "source", "bad": [[step, rank, holder]],
  "retrying"}``: ``retrying`` when the rank will try unreachable sources again (no replan).
- ``POST /v1/jobs/{namespace}/{job}/restore-from``: ``{"step"}``; the next restore uses that step
  (a rollback); 409 when no tier holds it complete.
- ``GET  /v1/status[?job=NAME]``, ``GET /healthz``, ``GET /metrics``.
"""

import dataclasses
import json
import logging
import os
import ssl
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, generate_latest

from replicator import pod_files
from replicator.bearer import read_token, require_bearer
from replicator.coordinator.state import ClusterState, JobState, NodeIdTaken, NotReady, UnknownIncarnation
from replicator.messages import MAX_RANKS, JobSettings, NodeReport, decode, to_json

log = logging.getLogger(__name__)

_STATE_KEY = web.AppKey("state", ClusterState)
_CONFIG_KEY = web.AppKey("config", "CoordinatorConfig")
# A report of a node holding 16k steps of 60 files stays well below this; anything larger is refused (413).
MAX_BODY_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of ``mtc coordinator``.

    Attributes:
      listen: ``HOST:PORT``.
      state_dir: where a snapshot of job settings is kept to warm a restart, or None. Only an
        accelerator: node reports rebuild everything.
      node_timeout_seconds: a node silent this long is silent: no orders to it, its copies not counted
        as safe; its pods stay in their incarnation until unpublished or replaced, seconds.
      holder_grace_seconds: a silent node's copies stay restore sources (waited for) this long, seconds.
      token_file: the cluster's shared token (the peer token's Secret): every route that changes
        state or hands out a restore plan requires it. Status, health and metrics stay open. None
        runs open (``--insecure``), with a warning.
      tls_cert, tls_key: serve HTTPS with this certificate (PEM files), or None for plain HTTP.
      max_nodes: the largest job a report may describe (a pod's ``nodes``).
    """

    listen: str
    state_dir: str | None = None
    node_timeout_seconds: float = 15.0
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_nodes: int = MAX_RANKS
    holder_grace_seconds: float = 60.0

    def server_ssl(self) -> ssl.SSLContext | None:
        """The TLS context to serve with, or None for plain HTTP.

        Raises:
          OSError, ssl.SSLError: the certificate or key cannot be loaded.
        """
        if self.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context


class BadRequest(web.HTTPBadRequest):
    def __init__(self, message: str):
        super().__init__(text=json.dumps({"error": message}), content_type="application/json")


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _job_key(request: web.Request) -> tuple[str, str]:
    return request.match_info["namespace"], request.match_info["job"]


def _not_found(err: Exception) -> web.HTTPNotFound:
    return web.HTTPNotFound(text=json.dumps({"error": str(err)}), content_type="application/json")


async def post_report(request: web.Request) -> web.Response:
    try:
        report = decode(await _json_body(request), NodeReport)
    except ValueError as err:
        raise BadRequest(str(err)) from None
    max_nodes = request.app[_CONFIG_KEY].max_nodes
    for index, pod in enumerate(report.pods):
        if pod.nodes > max_nodes or pod.slices > pod.nodes:
            raise BadRequest(f"pods[{index}]: nodes={pod.nodes} must be at most {max_nodes} and slices={pod.slices} at most nodes")
    try:
        reply = request.app[_STATE_KEY].apply_report(report, time.time())
    except NodeIdTaken as err:
        log.warning("refused a report from %s: %s", request.remote, err)
        raise web.HTTPConflict(text=json.dumps({"error": str(err)}), content_type="application/json") from None
    return web.json_response(to_json(reply))


async def post_settings(request: web.Request) -> web.Response:
    body = await _json_body(request)
    try:
        settings = decode(body.get("settings"), JobSettings)
        incarnation, rank = str(body["incarnation"]), int(body["rank"])
    except (ValueError, KeyError, TypeError) as err:
        raise BadRequest(f"bad settings request: {err}") from None
    try:
        request.app[_STATE_KEY].record_settings(_job_key(request), incarnation, rank, settings)
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    _save_snapshot(request.app)
    return web.json_response({"ok": True})


async def get_restore(request: web.Request) -> web.Response:
    try:
        incarnation, rank = request.query["incarnation"], int(request.query["rank"])
    except (KeyError, ValueError) as err:
        raise BadRequest(f"incarnation and rank query parameters are required: {err}") from None
    try:
        view = request.app[_STATE_KEY].restore_view(_job_key(request), incarnation, rank, time.time())
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    except NotReady as err:
        raise web.HTTPServiceUnavailable(text=json.dumps({"error": str(err)}), content_type="application/json") from None
    return web.json_response(to_json(view))


async def post_restore(request: web.Request) -> web.Response:
    body = await _json_body(request)
    try:
        bad = [(int(step), int(rank), str(holder)) for step, rank, holder in body.get("bad", [])]
        source = None if body.get("source") is None else str(body["source"])
        args = (str(body["incarnation"]), str(body["generation"]), int(body["rank"]))
        retrying = bool(body.get("retrying", False))
    except (ValueError, KeyError, TypeError) as err:
        raise BadRequest(f"bad restore report: {err}") from None
    try:
        request.app[_STATE_KEY].report_staged(_job_key(request), *args, source, bad, retrying)
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    return web.json_response({"ok": True})


async def post_restore_from(request: web.Request) -> web.Response:
    body = await _json_body(request)
    try:
        step = int(body["step"])
    except (KeyError, ValueError, TypeError) as err:
        raise BadRequest(f"body must be {{\"step\": <int>}}: {err}") from None
    try:
        request.app[_STATE_KEY].force_restore_step(_job_key(request), step)
    except LookupError as err:
        raise web.HTTPConflict(text=json.dumps({"error": str(err)}), content_type="application/json") from None
    return web.json_response({"ok": True, "step": step})


async def get_status(request: web.Request) -> web.Response:
    state = request.app[_STATE_KEY]
    state.expire(time.time())
    status = state.status()
    if "job" in request.query:
        status["jobs"] = [j for j in status["jobs"] if j["job"] == request.query["job"]]
    return web.json_response(status)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[_STATE_KEY]
    state.expire(time.time())
    registry = CollectorRegistry()  # the cluster view, computed now; the process's counters follow
    labels = ["namespace", "job"]
    newest = Gauge("mtc_newest_complete_step", "Newest step complete for every rank", labels, registry=registry)
    backed = Gauge("mtc_newest_backup_step", "Newest step complete in the backup tier", labels, registry=registry)
    backed_at = Gauge("mtc_last_backup_timestamp_seconds", "Unix time this coordinator saw the last backup complete", labels, registry=registry)
    every_steps = Gauge("mtc_backup_interval_steps", "The job's backup-interval-steps", labels, registry=registry)
    every_seconds = Gauge("mtc_backup_interval_seconds", "The job's backup-interval-minutes, in seconds", labels, registry=registry)
    live = Gauge("mtc_live_nodes", "Node agents reporting", registry=registry)
    live.set(sum(map(state.is_live, state.nodes)))
    for key, job in state.jobs.items():
        for gauge, value in [(newest, state.newest_complete_step(key)), (backed, max(state.backed_up(key), default=None)),
                             (backed_at, job.last_backup_time)]:  # fmt: skip
            if value is not None:
                gauge.labels(*key).set(value)
        settings = next(iter(job.settings.values()), None)
        if settings is not None and settings.backup_interval_steps is not None:
            every_steps.labels(*key).set(settings.backup_interval_steps)
        elif settings is not None and settings.backup_interval_minutes is not None:
            every_seconds.labels(*key).set(settings.backup_interval_minutes * 60)
    return web.Response(body=generate_latest(registry) + generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _snapshot_path(app: web.Application) -> str | None:
    state_dir = app[_CONFIG_KEY].state_dir
    return os.path.join(state_dir, "settings.json") if state_dir else None


def _save_snapshot(app: web.Application) -> None:
    path = _snapshot_path(app)
    if path is None:
        return
    snapshot = [
        {"namespace": ns, "job": job, "settings": {str(r): to_json(s) for r, s in state.settings.items()}}
        for (ns, job), state in app[_STATE_KEY].jobs.items()
    ]
    pod_files.write_file_atomic(path, json.dumps(snapshot).encode())


def _load_snapshot(app: web.Application) -> None:
    path = _snapshot_path(app)
    if path is None or not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            for item in json.load(f):
                job = app[_STATE_KEY].jobs.setdefault((item["namespace"], item["job"]), JobState())
                job.settings.update({int(r): decode(s, JobSettings) for r, s in item["settings"].items()})
    except (OSError, ValueError, KeyError) as err:
        log.warning("ignoring unreadable state snapshot %s: %s", path, err)


def make_app(config: CoordinatorConfig) -> web.Application:
    """The coordinator's aiohttp application."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[_CONFIG_KEY] = config
    app[_STATE_KEY] = ClusterState(config.node_timeout_seconds, config.holder_grace_seconds)
    if config.state_dir:
        os.makedirs(config.state_dir, exist_ok=True)
        _load_snapshot(app)
    token = read_token(config.token_file) if config.token_file else None
    if token is None:
        log.warning("INSECURE: no --token-file; anyone who reaches %s can assign ranks, plan restores and order "
                    "deletions. Use --insecure only on a one-machine experiment.", config.listen)  # fmt: skip
    guard = (lambda handler: require_bearer(handler, token)) if token else (lambda handler: handler)
    app.add_routes([
        web.post("/v1/report", guard(post_report)),
        web.post("/v1/jobs/{namespace}/{job}/settings", guard(post_settings)),
        web.get("/v1/jobs/{namespace}/{job}/restore", guard(get_restore)),
        web.post("/v1/jobs/{namespace}/{job}/restore", guard(post_restore)),
        web.post("/v1/jobs/{namespace}/{job}/restore-from", guard(post_restore_from)),
        web.get("/v1/status", get_status),
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
    ])  # fmt: skip
    return app


def run_coordinator(config: CoordinatorConfig) -> None:
    """Serves until SIGTERM or SIGINT."""
    host, _, port = config.listen.rpartition(":")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    web.run_app(make_app(config), host=host, port=int(port), ssl_context=config.server_ssl(), print=None)
