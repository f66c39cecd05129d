"""``mtc coordinator``: one small aiohttp service per cluster, holding soft state only.

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
  ``GET /healthz``, ``GET /metrics``.

A job no node has reported is a 404.

Bodies are typed (``replicator.wire.messages``) and decoded here, at the edge: a body that does not
decode is answered 400 with an error naming the field. Acknowledgements are a ``Done``.

With ``kube`` settings the coordinator also watches the API server (``kube_watch``), and every report passes
through ``kube_overlay`` first: JobSet pods take their shape, ranks and rank 0's address from there.
"""

import asyncio
import asyncio.sslproto
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import resource
import ssl
import time
from typing import TypeVar

import msgspec
import yaml
from aiohttp import web
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ConfigError
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from csi_driver import atomic_file
from replicator.coordinator.kube_overlay import KubeOverlay
from replicator.coordinator.kube_shape import ShapeSettings
from replicator.coordinator.kube_watch import ShapeWatcher, WatchSettings
from replicator.coordinator import report_order
from replicator.coordinator.report_order import ReportOrder, StaleReport
from replicator.coordinator.rollbacks import NotCancellable
from replicator.coordinator.state import (
    ClusterState,
    NodeIdTaken,
    NotReady,
    UnknownIncarnation,
    UnknownJob,
)
from replicator.wire import tls
from replicator.wire.bearer import Tokens, require_bearer
from replicator.wire.http_errors import error_response
from replicator.wire.messages import (
    MAX_RANKS,
    MAX_WAIT_SECONDS,
    REPORT_ORDER_HEADER,
    JobRef,
    JobSettings,
    NodeReport,
    ProtocolMismatch,
    SettingsRequest,
    StagedReport,
    Step,
    Versioned,
    check_version,
    decode,
    decode_json,
)
from replicator.wire.metric_labels import JOB_LABELS
from replicator.wire.operator import Done, RestoreFrom

log = logging.getLogger(__name__)

REPORT_BYTES = Counter("mtc_coordinator_report_bytes_total", "Bytes of report bodies received from node agents")
# How late the ticker wakes is how long the event loop was busy: every request waited as long.
LOOP_LAG = Histogram("mtc_coordinator_loop_lag_seconds", "How late the coordinator's ticker woke: its event loop was busy that long",
                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))  # fmt: skip

M = TypeVar("M")
_STATE_KEY = web.AppKey("state", ClusterState)
_CONFIG_KEY = web.AppKey("config", "CoordinatorConfig")
_CHANGES_KEY = web.AppKey("changes", "JobChanges")
_SNAPSHOT_KEY = web.AppKey("snapshot", "SettingsSnapshot")
_OVERLAY_KEY = web.AppKey("overlay", KubeOverlay)
_ORDER_KEY = web.AppKey("report_order", ReportOrder)
# Expiry and due decision passes run this often, seconds.
_TICK_SECONDS = 0.25
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
      token_file: the cluster's shared tokens (the peer token's Secret, one per line, read again when it
        changes): every route that changes state or hands out a restore plan requires one of them. Status, health and metrics stay open. None
        runs open (``--insecure``), with a warning.
      tls_cert, tls_key: serve HTTPS with this certificate (PEM files), or None for plain HTTP.
      max_nodes: the largest job a report may describe (a pod's ``nodes``).
      kube: read job shapes, ranks, rank 0's address and failure domains from the API server, or None to take
        them from the volumes' attributes alone.
      restore_fan_out: a restore from the backup tier alone reads each unique shard once per group
        of identical data-parallel ranks; the others fetch it from that node (``ClusterState``).
      shared_backup_upload: identical data-parallel ranks share a backup's upload (``ClusterState``).
    """

    listen: str
    state_dir: str | None = None
    node_timeout_seconds: float = 15.0
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_nodes: int = MAX_RANKS
    holder_grace_seconds: float = 60.0
    kube: "KubeSettings | None" = None
    restore_fan_out: bool = True
    shared_backup_upload: bool = False

    def server_ssl(self) -> ssl.SSLContext | None:
        """The TLS context to serve with, or None for plain HTTP.

        Raises:
          OSError, ssl.SSLError: the certificate or key cannot be loaded.
        """
        return tls.server_context(self.tls_cert, self.tls_key)


@dataclasses.dataclass(frozen=True)
class KubeSettings:
    """How the coordinator reads the API server (``mtc coordinator --kube``).

    Attributes:
      kubeconfig: a kubeconfig file, or None for the pod's service account (in cluster) or ``$KUBECONFIG``.
      namespace: the one namespace to watch Pods and JobSets in, or None for all.
      shape: our CSI driver's name and the node label naming a block or rack.
    """

    kubeconfig: str | None = None
    namespace: str | None = None
    shape: ShapeSettings = dataclasses.field(default_factory=ShapeSettings)


def kube_config(settings: KubeSettings) -> KubeConfig:
    """Where the API server is and how to authenticate: ``settings.kubeconfig``, else the pod's service account,
    else ``$KUBECONFIG`` or ``~/.kube/config`` (lightkube's order).

    Raises:
      ValueError: none of them is usable; the message names what was tried and why it failed.
    """
    tried = settings.kubeconfig or "the pod's service account, $KUBECONFIG, ~/.kube/config"
    try:
        config = KubeConfig.from_file(settings.kubeconfig) if settings.kubeconfig else KubeConfig.from_env()
        config.get()  # the current context: its cluster and user
        return config
    except (ConfigError, OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as err:
        raise ValueError(f"--kube: no usable API server configuration in {tried}: {err!r}") from None


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


async def _reply(request: web.Request, message) -> web.StreamResponse:
    """``message`` as the JSON response to ``request``, written in pieces of at most ``WRITE_PIECE_BYTES``."""
    body = msgspec.json.encode(message)
    if len(body) <= WRITE_PIECE_BYTES:
        return web.Response(body=body, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    await response.prepare(request)
    pieces = memoryview(body)
    for start in range(0, len(body), WRITE_PIECE_BYTES):
        await response.write(pieces[start:start + WRITE_PIECE_BYTES])
    await response.write_eof()
    return response


class JobChanges:
    """Wakes long polls when a job's assignments or restore views may have changed: one event per
    job, replaced each time it fires, so a waiter sees every change after it started waiting."""

    def __init__(self, state: ClusterState):
        self._state = state
        self._events: dict[JobRef, asyncio.Event] = {}

    def event(self, key: JobRef) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def publish(self) -> None:
        """Fires the events of every job the state marked changed."""
        self.wake(self._state.drain_changed())

    def wake(self, keys) -> None:
        """Fires the events of ``keys``."""
        for key in keys:
            if (event := self._events.pop(key, None)) is not None:
                event.set()

    async def wait(self, keys, timeout: float) -> None:
        """Waits until one of ``keys`` changes or ``timeout`` seconds pass."""
        keys = list(keys)
        if len(keys) == 1:
            # The common case (a node's one waiting pod): no task per waiter. A new incarnation of a
            # 10,000-node job starts and wakes 10,000 of these at once.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.event(keys[0]).wait()
            return
        waiters = [asyncio.ensure_future(self.event(key).wait()) for key in keys]
        if not waiters:
            return
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


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


async def post_report(request: web.Request) -> web.Response:
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
    max_nodes = request.app[_CONFIG_KEY].max_nodes
    for index, pod in enumerate(report.pods):
        if pod.nodes > max_nodes or pod.slices > pod.nodes:
            raise BadRequest(f"pods[{index}]: nodes={pod.nodes} must be at most {max_nodes} and slices={pod.slices} at most nodes")
    state, changes, overlay = request.app[_STATE_KEY], request.app[_CHANGES_KEY], request.app.get(_OVERLAY_KEY)
    seen = overlay.version if overlay else 0
    try:
        request.app[_ORDER_KEY].admit(report.node_id, order)
    except StaleReport as err:
        log.warning("refused a report from %s: %s", request.remote, err)
        raise _conflict(err) from None
    reply = _take_report(state, overlay, report, request.remote)
    changes.publish()
    deadline = time.monotonic() + MAX_WAIT_SECONDS
    # Long poll: held while a pod waits for its assignment. The agent cancels it (the handler is
    # cancelled with the connection) when it has something new to report.
    while report.waiting and time.monotonic() < deadline:
        assigned = {a.pod_uid for a in reply.assignments}
        waiting = {JobRef(p.namespace, p.job) for p in report.pods if p.incarnation is None and p.pod_uid not in assigned}
        if not waiting:
            break
        await changes.wait(waiting, min(deadline - time.monotonic(), state.heartbeat_seconds))
        if overlay and overlay.version != seen:  # the API server placed (or moved) pods: the report again
            seen = overlay.version
            if not request.app[_ORDER_KEY].is_newest(report.node_id, order):
                break  # the node has reported since: this held report is not its state any more
            reply = _take_report(state, overlay, report, request.remote)
            changes.publish()
            continue
        state.touch(report.node_id, time.time())
        reply = state.reply_for(report.node_id)
    return await _reply(request, reply)


def _take_report(state: ClusterState, overlay: KubeOverlay | None, report: NodeReport, remote: str | None):
    """The state's reply to ``report``, laid under the API server's shapes when the coordinator reads them.

    Raises:
      HTTPConflict: the node id is taken by a live node at another URL.
    """
    try:
        return state.apply_report(overlay.apply(report) if overlay else report, time.time())
    except NodeIdTaken as err:
        log.warning("refused a report from %s: %s", remote, err)
        raise _conflict(err) from None


async def post_settings(request: web.Request) -> web.Response:
    body = await _body(request, SettingsRequest)
    try:
        request.app[_STATE_KEY].record_settings(_job_key(request), body.incarnation, body.rank, body.settings)
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    request.app[_SNAPSHOT_KEY].due = True
    return await _reply(request, Done(True))


async def get_restore(request: web.Request) -> web.Response:
    try:
        incarnation, rank = request.query["incarnation"], int(request.query["rank"])
        wait = min(float(request.query.get("wait", 0)), MAX_WAIT_SECONDS)
    except (KeyError, ValueError) as err:
        raise BadRequest(f"incarnation and rank query parameters are required, wait is seconds: {err}") from None
    key, seen = _job_key(request), request.query.get("seen")
    state, changes = request.app[_STATE_KEY], request.app[_CHANGES_KEY]
    deadline = time.monotonic() + wait
    with contextlib.suppress(UnknownIncarnation):  # answered below
        state.touch_rank(key, incarnation, rank, time.time())  # when it asks: a killed agent's poll may linger
    while True:
        try:
            view = state.restore_view(key, incarnation, rank, time.time())
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
            return await _reply(request, view)
        # Not held while waiting: a view carries its sources' checksums unpacked (about 15 KB a
        # listed copy), and every rank of a restoring job long-polls at once.
        del view
        await changes.wait([key], deadline - time.monotonic())


async def post_restore(request: web.Request) -> web.Response:
    body = await _body(request, StagedReport)
    try:
        request.app[_STATE_KEY].report_staged(_job_key(request), body.incarnation, body.generation, body.rank, body.source,
                                              body.bad, body.retrying)  # fmt: skip
    except UnknownIncarnation as err:
        raise _not_found(err) from None
    request.app[_CHANGES_KEY].publish()
    return await _reply(request, Done(True))


async def post_restore_from(request: web.Request) -> web.Response:
    body = await _body(request, RestoreFrom)
    try:
        request.app[_STATE_KEY].force_restore_step(_job_key(request), body.step)
    except UnknownJob as err:
        raise _not_found(err) from None
    except LookupError as err:
        raise _conflict(err) from None
    return await _reply(request, Done(True, body.step))


async def get_restore_from(request: web.Request) -> web.Response:
    try:
        step = decode(int(request.query["step"]), Step)
    except (KeyError, ValueError) as err:
        raise BadRequest(f"the step query parameter must be a step number: {err}") from None
    try:
        return await _reply(request, request.app[_STATE_KEY].rollback_preview(_job_key(request), step))
    except UnknownJob as err:
        raise _not_found(err) from None
    except LookupError as err:
        raise _conflict(err) from None


async def delete_restore_from(request: web.Request) -> web.Response:
    try:
        step = request.app[_STATE_KEY].cancel_restore_step(_job_key(request))
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


async def get_status(request: web.Request) -> web.Response:
    state = request.app[_STATE_KEY]
    state.tick(time.time())
    try:
        return await _reply(request, state.status(_status_keys(state, request.query.get("job"))))
    except UnknownJob as err:
        raise _not_found(err) from None


async def healthz(request: web.Request) -> web.Response:
    return await _reply(request, Done(True))


class _ClusterGauges:
    """The cluster as the coordinator sees it, as Prometheus gauges read from ``state`` at each
    scrape. The families are built directly, not through labelled ``Gauge`` children: at 1,250 jobs
    the children cost 70-120 ms a scrape (0.5 s under load) with the event loop blocked, and every
    report queued behind a scrape waited as long. Per node, only the silent ones are listed (a few,
    walked oldest first and stopping at the first live one), never all 10,000."""

    def __init__(self, state: ClusterState):
        self._state = state

    def collect(self) -> list[GaugeMetricFamily]:
        state, labels = self._state, list(JOB_LABELS)
        newest = GaugeMetricFamily("mtc_newest_complete_step", "Newest step complete for every rank", labels=labels)
        backed = GaugeMetricFamily("mtc_newest_backup_step", "Newest step complete in the backup tier", labels=labels)
        backed_at = GaugeMetricFamily("mtc_last_backup_timestamp_seconds", "Unix time this coordinator saw the last backup complete", labels=labels)
        every_steps = GaugeMetricFamily("mtc_backup_interval_steps", "The job's backup-interval-steps", labels=labels)
        every_seconds = GaugeMetricFamily("mtc_backup_interval_seconds", "The job's backup-interval-minutes, in seconds", labels=labels)
        ranks = GaugeMetricFamily("mtc_restore_ranks", "Ranks of the job's current incarnation, once its restore is planned", labels=labels)
        staged = GaugeMetricFamily("mtc_restore_ranks_staged", "Ranks that staged the planned step (all for a fresh start); done at mtc_restore_ranks",
                                   labels=labels)  # fmt: skip
        for key in state.job_keys():
            job, values = state.job(key), [key.namespace, key.job]
            for family, value in [(newest, state.newest_complete_step(key)), (backed, max(state.backed_up(key), default=None)),
                                  (backed_at, job.last_backup_time)]:  # fmt: skip
                if value is not None:
                    family.add_metric(values, value)
            settings = next(iter(job.settings.values()), None)
            if settings is not None and settings.backup_interval_steps is not None:
                every_steps.add_metric(values, settings.backup_interval_steps)
            elif settings is not None and settings.backup_interval_minutes is not None:
                every_seconds.add_metric(values, settings.backup_interval_minutes * 60)
            if (incarnation := job.incarnation) is not None and incarnation.plan is not None:
                ranks.add_metric(values, len(incarnation.node_of_rank))
                # A fresh start (no step) has nothing to stage: every rank is ready at once.
                staged.add_metric(values, len(incarnation.node_of_rank if incarnation.plan.step is None else incarnation.staged))
        live = GaugeMetricFamily("mtc_live_nodes", "Node agents reporting", value=state.liveness.live_count())
        silent_ids = state.liveness.silent()
        silent = GaugeMetricFamily("mtc_silent_nodes", "Node agents silent past the node timeout, not yet forgotten", value=len(silent_ids))
        silence = GaugeMetricFamily("mtc_node_silent_seconds", "Seconds since each silent node agent last reported (silent ones only)",
                                    labels=["node"])  # fmt: skip
        for node_id in silent_ids:
            silence.add_metric([node_id], state.liveness.silence(node_id))
        return [newest, backed, backed_at, every_steps, every_seconds, ranks, staged, live, silent, silence]


async def metrics(request: web.Request) -> web.Response:
    state = request.app[_STATE_KEY]
    state.tick(time.time())
    registry = CollectorRegistry()  # the cluster view, computed now; the process's counters follow
    registry.register(_ClusterGauges(state))
    return web.Response(body=generate_latest(registry) + generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


# The settings snapshot is written at most this often while settings keep arriving: a job of 10,000
# ranks records its settings over many ticks, and every write encodes them all (3.4 MB). Settings
# recorded since the last write are not lost with a crash: every report carries its pods' settings.
SNAPSHOT_INTERVAL_SECONDS = 2.0


class SettingsSnapshot:
    """The job settings kept in ``<state_dir>/settings.json`` to warm a restart.

    Written by the ticker when settings changed (``due``), not by each settings request: one write
    costs the size of every job's settings and two fsyncs, so a write per request made a job start of
    N ranks cost N² in the event loop (minutes at 10,000 ranks).
    """

    def __init__(self, state_dir: str | None):
        self.path = os.path.join(state_dir, "settings.json") if state_dir else None
        self.due = False
        self._encoded_at = float("-inf")

    def encode(self, cluster: ClusterState, now: float) -> bytes | None:
        """The snapshot to write if one is due and none was encoded in the last
        ``SNAPSHOT_INTERVAL_SECONDS`` before ``now`` (monotonic seconds); clears ``due``. Else None."""
        if self.path is None or not self.due or now - self._encoded_at < SNAPSHOT_INTERVAL_SECONDS:
            return None
        self.due, self._encoded_at = False, now
        return msgspec.json.encode([
            {"namespace": key.namespace, "job": key.job, "settings": {str(r): s for r, s in cluster.job(key).settings.items()}}
            for key in cluster.job_keys()
        ])  # fmt: skip

    def write(self, data: bytes) -> None:
        """Writes ``data`` crash-safe (tmp, fsync, rename). Raises OSError."""
        atomic_file.write_file_atomic(self.path, data)


def _load_snapshot(app: web.Application) -> None:
    path = app[_SNAPSHOT_KEY].path
    if path is None or not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            for item in json.load(f):
                key = JobRef(item["namespace"], item["job"])
                for rank, settings in item["settings"].items():
                    app[_STATE_KEY].restore_settings(key, int(rank), decode(settings, JobSettings))
    except (OSError, ValueError, KeyError) as err:
        log.warning("ignoring unreadable state snapshot %s: %s", path, err)


async def _ticker(app: web.Application):
    """Expires nodes and runs due decision passes in the background, waking long polls they affect,
    and writes the settings snapshot when settings changed (once more on shutdown)."""

    async def tick_forever():
        while True:
            asleep = time.monotonic()
            await asyncio.sleep(_TICK_SECONDS)
            LOOP_LAG.observe(time.monotonic() - asleep - _TICK_SECONDS)
            try:
                app[_STATE_KEY].tick(time.time())
                app[_CHANGES_KEY].publish()
                gc.collect(1)  # by the clock, not by the count (``GC_THRESHOLDS``)
                if (data := app[_SNAPSHOT_KEY].encode(app[_STATE_KEY], time.monotonic())) is not None:
                    await asyncio.to_thread(app[_SNAPSHOT_KEY].write, data)
            except Exception:  # a bug in one pass must not stop expiry for the cluster
                log.exception("coordinator tick failed, carrying on")

    task = asyncio.create_task(tick_forever())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if (data := app[_SNAPSHOT_KEY].encode(app[_STATE_KEY], float("inf"))) is not None:  # the last changes, whenever the previous write
        app[_SNAPSHOT_KEY].write(data)


async def _kube_watcher(app: web.Application):
    """Watches the API server for job shapes while the app runs; each new set goes to the overlay and wakes
    the long polls of the jobs whose shape changed."""
    settings: KubeSettings = app[_CONFIG_KEY].kube
    config = kube_config(settings)
    client = AsyncClient(config, field_manager="mtc-coordinator")
    watcher = ShapeWatcher(client, WatchSettings(namespace=settings.namespace, shape=settings.shape),
                           on_change=lambda shapes: app[_CHANGES_KEY].wake(app[_OVERLAY_KEY].update(shapes)))  # fmt: skip
    task = asyncio.create_task(watcher.run(), name="kube shapes")
    log.info("reading job shapes from the API server at %s", config.get().cluster.server)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await client.close()


def make_app(config: CoordinatorConfig) -> web.Application:
    """The coordinator's aiohttp application."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[_CONFIG_KEY] = config
    app[_STATE_KEY] = ClusterState(config.node_timeout_seconds, config.holder_grace_seconds, config.restore_fan_out, config.shared_backup_upload)
    app[_ORDER_KEY] = ReportOrder()
    app[_CHANGES_KEY] = JobChanges(app[_STATE_KEY])
    app[_SNAPSHOT_KEY] = SettingsSnapshot(config.state_dir)
    app.cleanup_ctx.append(_ticker)
    if config.kube is not None:
        app[_OVERLAY_KEY] = KubeOverlay()
        app.cleanup_ctx.append(_kube_watcher)
    if config.state_dir:
        os.makedirs(config.state_dir, exist_ok=True)
        _load_snapshot(app)
    tokens = Tokens(config.token_file) if config.token_file else None  # read again when the file changes
    if tokens is None:
        log.warning("INSECURE: no --token-file; anyone who reaches %s can assign ranks, plan restores and order "
                    "deletions. Use --insecure only on a one-machine experiment.", config.listen)  # fmt: skip
    guard = (lambda handler: require_bearer(handler, tokens)) if tokens else (lambda handler: handler)
    app.add_routes([
        web.post("/v1/report", guard(post_report)),
        web.post("/v1/jobs/{namespace}/{job}/settings", guard(post_settings)),
        web.get("/v1/jobs/{namespace}/{job}/restore", guard(get_restore)),
        web.post("/v1/jobs/{namespace}/{job}/restore", guard(post_restore)),
        web.post("/v1/jobs/{namespace}/{job}/restore-from", guard(post_restore_from)),
        web.get("/v1/jobs/{namespace}/{job}/restore-from", get_restore_from),  # a preview: read-only, like status
        web.delete("/v1/jobs/{namespace}/{job}/restore-from", guard(delete_restore_from)),
        web.get("/v1/status", get_status),
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
    ])  # fmt: skip
    return app


# The garbage collector. What a collection visits is mostly what the last request on each keep-alive
# connection left alive: aiohttp keeps a connection's last request and response (about 60 objects)
# until its next request, 10 s at 10,000 nodes. Those objects outlive two collections and die in the
# old generation, and each death takes one off the young generation's count of net allocations: with
# many small jobs the count stayed near zero while 300,000 young objects piled up, and the young and
# middle collections that finally came paused the event loop 0.4-0.9 s (the many-jobs report p99
# was 450-900 ms at 10,000 nodes). So the ticker collects the young and middle generations together
# every tick (``_TICK_SECONDS``), whatever the count says: each object is visited once, not twice,
# and a pause is what arrived in a quarter second (under 30 ms at 10,000 nodes). The thresholds stay
# for what comes between ticks; a full collection (the cluster's state: message structs are
# untracked, ``messages.py``) waits for 14,400 middle ones, an hour of ticks, and Python's own rule
# that a quarter of the old objects are new (1.6 s at 10,000 nodes, measured at shutdown).
GC_THRESHOLDS = (10_000, 5, 14_400)


# Each node keeps one or two connections open to the coordinator (its reports and a restore's long poll),
# each an open file; the rest is the coordinator's own (listening socket, API watches, logs).
CONNECTIONS_PER_NODE = 2
OTHER_OPEN_FILES = 1_000


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit, as Go programs do at start.

    Container runtimes commonly give a soft limit of 1,024 under a hard one of 524,288 or more; at
    ``CONNECTIONS_PER_NODE`` files a node, 1,024 runs out before 500 nodes.

    Returns:
      The soft limit in force afterwards (``resource.RLIM_INFINITY`` when unlimited).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:  # a platform that refuses the hard limit keeps the soft one
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, err)
    return soft


# asyncio's TLS transport gives every connection a read buffer of ``SSLProtocol.max_size``, 256 KiB,
# allocated and zeroed when the connection opens (python/cpython#109534): 2.5 GiB of the 4.2 GB the
# coordinator held at 10,000 nodes with one connection each. A TLS record holds at most 16 KiB, so one
# record a read costs nothing measurable. The buffer is only a landing place: the transport receives into
# it and the protocol copies what came into OpenSSL's input at once, in the same call, on the event
# loop's one thread. So every connection can land in the same buffer: 16 KiB per process, not per
# connection (16 KB of the 49 KB an idle connection held, ``tests.bench.connection_memory``).
TLS_READ_BUFFER_BYTES = 16 * 1024


def share_tls_read_buffer() -> None:
    """Makes every TLS connection this process opens or accepts from now on read into one buffer of
    ``TLS_READ_BUFFER_BYTES``, shared by all of them. For the selector event loop (Linux's), whose
    transports fill the buffer and hand it to the protocol in one call; idempotent."""
    protocol = asyncio.sslproto.SSLProtocol
    if getattr(protocol.__init__, "shares_read_buffer", False):
        return
    protocol.max_size = TLS_READ_BUFFER_BYTES
    buffer = bytearray(TLS_READ_BUFFER_BYTES)
    view = memoryview(buffer)
    init = protocol.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._ssl_buffer, self._ssl_buffer_view = buffer, view  # what ``get_buffer`` and ``buffer_updated`` use

    __init__.shares_read_buffer = True
    protocol.__init__ = __init__


def run_coordinator(config: CoordinatorConfig) -> None:
    """Serves until SIGTERM or SIGINT."""
    host, _, port = config.listen.rpartition(":")
    files = raise_open_file_limit()
    if files != resource.RLIM_INFINITY:
        log.info("open-file limit %d: enough for about %d nodes", files, max(0, files - OTHER_OPEN_FILES) // CONNECTIONS_PER_NODE)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    share_tls_read_buffer()
    app = make_app(config)
    gc.freeze()  # the modules and the app live as long as the process: no collection need walk them
    gc.set_threshold(*GC_THRESHOLDS)
    # handler_cancellation: a long poll whose agent hung up stops at once.
    web.run_app(app, host=host, port=int(port), ssl_context=config.server_ssl(), print=None, handler_cancellation=True)
