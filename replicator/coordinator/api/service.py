"""``mtc coordinator``: one small aiohttp service per cluster, holding soft state only.

This module assembles it: the app (``make_app``: the cluster's state, the routes of ``routes``
behind the bearer check, the settings snapshot), the ticker that expires nodes and runs due decision
passes, and the process that serves it (``run_coordinator``, tuned by ``process_tuning``).

With ``kube`` settings the coordinator also watches the API server (``kube_watch``), and every report passes
through ``kube_overlay`` first: JobSet pods take their shape, ranks and rank 0's address from there. With operator
identity the operators' routes ask it who the caller is and what RBAC lets it do (``operator_auth``).
"""

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import AsyncIterator

from aiohttp import web
from lightkube import AsyncClient
from prometheus_client import Histogram

from replicator.coordinator.api import process_tuning, routes
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.job_changes import JobChanges
from replicator.coordinator.api.recovery_snapshot import RecoverySnapshot
from replicator.coordinator.api.routes import (
    CHANGES_KEY,
    CONFIG_KEY,
    KUBE_CLIENT_KEY,
    NOTICES_KEY,
    ORDER_KEY,
    OVERLAY_KEY,
    SIGNER_KEY,
    SNAPSHOT_KEY,
    STATE_KEY,
    VERIFIER_KEY,
)
from replicator.coordinator.api.settings_snapshot import SettingsSnapshot
from replicator.coordinator.kube.jobset_annotations import JobSetAnnotations
from replicator.coordinator.kube.kube_config import KubeSettings, kube_config
from replicator.coordinator.kube.kube_events import EventRecorder
from replicator.coordinator.kube.kube_overlay import KubeOverlay
from replicator.coordinator.kube.kube_watch import ShapeWatcher, WatchSettings
from replicator.coordinator.kube.node_notices import NoticeEvents
from replicator.coordinator.kube.restore_events import RestoreEvents
from replicator.coordinator.state import ClusterState
from replicator.coordinator.trust.node_identity import NodeVerifier
from replicator.coordinator.trust.operator_auth import KubeOperators, OperatorAuth, Operators, TokenOperators
from replicator.coordinator.trust.report_order import ReportOrder
from replicator.wire.bearer import Tokens, require_bearer
from replicator.wire.grants import GrantSigner

log = logging.getLogger(__name__)

# How late the ticker wakes is how long the event loop was busy: every request waited as long.
LOOP_LAG = Histogram(
    "mtc_coordinator_loop_lag_seconds",
    "How late the coordinator's ticker woke: its event loop was busy that long",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
# What restores and backups need that no report brings back, kept in the state dir (``recovery_snapshot``).
RECOVERY_KEY = web.AppKey("recovery", RecoverySnapshot)
# With --kube: the Events of restores on the training pods and JobSets (``restore_events``).
EVENTS_KEY = web.AppKey("events", RestoreEvents)
RECORDER_KEY = web.AppKey("recorder", EventRecorder)
# With --kube: the safe and backed-up steps as annotations on each JobSet (``jobset_annotations``).
ANNOTATIONS_KEY = web.AppKey("annotations", JobSetAnnotations)
# Expiry and due decision passes run this often, seconds.
TICK_SECONDS = 0.25
# A report of a node holding 16k steps of 60 files stays well below this; anything larger is refused (413).
MAX_BODY_BYTES = 256 << 20


def _tell_kube(app: web.Application) -> None:
    """Sends what the tick changed to the API server: restore events, JobSet annotations. Apart from the tick's
    own work, so that a failure here never holds up expiry or the snapshots restores need."""
    try:
        app[EVENTS_KEY].publish(app[STATE_KEY], app[OVERLAY_KEY].shapes)
        app[ANNOTATIONS_KEY].publish(app[STATE_KEY], app[OVERLAY_KEY].shapes)
    except Exception:  # a bug in what the operator sees must not stop the coordinator
        log.exception("restore events or JobSet annotations failed, carrying on")


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    """Expires nodes and runs due decision passes in the background, waking long polls they affect,
    and writes the settings snapshot when settings changed and the recovery snapshot when what restores need
    changed (each once more on shutdown)."""

    async def tick_forever() -> None:
        while True:
            asleep = time.monotonic()
            await asyncio.sleep(TICK_SECONDS)
            LOOP_LAG.observe(time.monotonic() - asleep - TICK_SECONDS)
            try:
                app[STATE_KEY].tick(time.time())
                app[CHANGES_KEY].publish()
                gc.collect(1)  # by the clock, not by the count (``process_tuning.GC_THRESHOLDS``)
                if (data := app[SNAPSHOT_KEY].encode(app[STATE_KEY], time.monotonic())) is not None:
                    await asyncio.to_thread(app[SNAPSHOT_KEY].write, data)
                if (jobs := app[RECOVERY_KEY].collect(app[STATE_KEY], time.monotonic())) is not None:
                    await asyncio.to_thread(app[RECOVERY_KEY].write, jobs)
            except Exception:  # a bug in one pass must not stop expiry for the cluster
                log.exception("coordinator tick failed, carrying on")
            if EVENTS_KEY in app:
                _tell_kube(app)

    task = asyncio.create_task(tick_forever())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if (
        data := app[SNAPSHOT_KEY].encode(app[STATE_KEY], float("inf"))
    ) is not None:  # the last changes, whenever the previous write
        app[SNAPSHOT_KEY].write(data)
    if (jobs := app[RECOVERY_KEY].collect(app[STATE_KEY], float("inf"))) is not None:
        app[RECOVERY_KEY].write(jobs)


async def _kube_watcher(app: web.Application) -> AsyncIterator[None]:
    """Watches the API server for job shapes while the app runs; each new set goes to the overlay and wakes
    the long polls of the jobs whose shape changed; with per-node identity, each agent pod and node deleted goes to
    the verifier."""
    settings: KubeSettings | None = app[CONFIG_KEY].kube
    assert settings is not None  # make_app runs the watcher only with kube settings
    client = app[KUBE_CLIENT_KEY]
    identity, verifier = app[CONFIG_KEY].node_identity, app.get(VERIFIER_KEY)
    watcher = ShapeWatcher(
        client,
        WatchSettings(
            namespace=settings.namespace,
            shape=settings.shape,
            agents_namespace=identity.namespace if identity is not None else None,
        ),
        on_change=lambda shapes: app[CHANGES_KEY].wake(app[OVERLAY_KEY].update(shapes)),
        # A token of a deleted agent pod or node is refused at once, not when it expires.
        on_deleted=(lambda gone: verifier.deleted(gone.uid)) if verifier is not None else None,
    )
    task = asyncio.create_task(watcher.run(), name="kube shapes")
    events = asyncio.create_task(app[RECORDER_KEY].run(), name="kube events")
    annotations = asyncio.create_task(app[ANNOTATIONS_KEY].run(), name="jobset annotations")
    log.info("reading job shapes from the API server at %s", client.config.cluster.server)
    yield
    for running in (task, events, annotations):
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    await client.close()


def make_app(config: CoordinatorConfig) -> web.Application:
    """The coordinator's aiohttp application."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[CONFIG_KEY] = config
    app[STATE_KEY] = ClusterState(
        config.node_timeout_seconds, config.holder_grace_seconds, config.restore_fan_out, config.shared_backup_upload
    )
    app[ORDER_KEY] = ReportOrder()
    app[CHANGES_KEY] = JobChanges(app[STATE_KEY])
    app[SNAPSHOT_KEY] = SettingsSnapshot(config.state_dir)
    app[RECOVERY_KEY] = RecoverySnapshot(config.state_dir)
    app.cleanup_ctx.append(_ticker)
    if config.kube is not None:
        app[OVERLAY_KEY] = KubeOverlay()
        # One client for the watches and the identity checks; made here (no I/O), closed by the watcher.
        app[KUBE_CLIENT_KEY] = AsyncClient(kube_config(config.kube), field_manager="mtc-coordinator")
        app[RECORDER_KEY] = EventRecorder(app[KUBE_CLIENT_KEY], host=os.environ.get("HOSTNAME", ""))
        app[EVENTS_KEY] = RestoreEvents(app[RECORDER_KEY])
        app[NOTICES_KEY] = NoticeEvents(app[RECORDER_KEY])
        app[ANNOTATIONS_KEY] = JobSetAnnotations(app[KUBE_CLIENT_KEY])
        app.cleanup_ctx.append(_kube_watcher)
        if config.node_identity is not None:
            app[VERIFIER_KEY] = NodeVerifier(app[KUBE_CLIENT_KEY], config.node_identity)
            log.info(
                "per-node identity: reports need a token of ServiceAccount %s/%s's DaemonSet %s pods, audience %s",
                config.node_identity.namespace,
                config.node_identity.service_account,
                config.node_identity.daemonset,
                config.node_identity.audience,
            )
    if config.peer_grants:
        app[SIGNER_KEY] = GrantSigner()
        log.info("peer grants: signing with key %s", app[SIGNER_KEY].key_id)
        if config.node_identity is None:
            log.warning(
                "peer grants without per-node identity (--node-identity): a holder of the cluster token can report "
                "as any node and be granted its copies"
            )
    if config.state_dir:
        os.makedirs(config.state_dir, exist_ok=True)
        app[SNAPSHOT_KEY].load(app[STATE_KEY])
        app[RECOVERY_KEY].load(app[STATE_KEY])
    tokens = Tokens(config.token_file) if config.token_file else None  # read again when the file changes
    if tokens is None:
        log.warning(
            "INSECURE: no --token-file; anyone who reaches %s can assign ranks, plan restores and order "
            "deletions. Use --insecure only on a one-machine experiment.",
            config.listen,
        )
    guard = (lambda handler: require_bearer(handler, tokens)) if tokens else (lambda handler: handler)
    routes.add_routes(app, guard, _operators(app, config, tokens, guard))
    return app


def _operators(
    app: web.Application, config: CoordinatorConfig, tokens: Tokens | None, guard: routes.Guard
) -> Operators:
    """How the operators' routes are guarded: by the caller's Kubernetes identity, or by the cluster token."""
    if config.operator_identity:
        log.info("operator identity: mtc restore-from and mtc status take the caller's own token, checked with RBAC")
        return KubeOperators(OperatorAuth(app[KUBE_CLIENT_KEY], tokens))
    if config.kube is not None:
        log.warning(
            "no --operator-identity: a rollback and its cancel take the cluster token alone, which every agent pod "
            "holds, and status shows every job to anyone who reaches %s",
            config.listen,
        )
    return TokenOperators(guard)


def run_coordinator(config: CoordinatorConfig) -> None:
    """Serves until SIGTERM or SIGINT."""
    host, _, port = config.listen.rpartition(":")
    process_tuning.prepare_for_connections()
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    app = make_app(config)
    process_tuning.tune_collector()
    # handler_cancellation: a long poll whose agent hung up stops at once.
    web.run_app(app, host=host, port=int(port), ssl_context=config.server_ssl(), print=None, handler_cancellation=True)
