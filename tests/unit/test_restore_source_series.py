"""A restore shows in the dashboard's series of the tier it came from.

The dashboard's "Restores by source" panel reads one series per tier; its close-peer series must be
the one a restore from a close peer increments (metric and ``source`` label). Here a real
``Restorer`` fetches a step over HTTP on loopback from a real peer service, as the restore plan's
``peer_close`` source, and the series the dashboard's query selects is read from this process's
``/metrics`` page before and after, and the job's in-flight gauges are read while the copy is
fetched. The label values every dashboard query and alert rule matches must also be ones the agent
exports for a job from its publish (seeded at zero).
"""

import asyncio
import contextlib
import json
import os
import re
import time

import aiohttp
import promql_parser
import yaml
from aiohttp import web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from csi_driver.ramdisk import Ramdisk
from prefetch import restore, stagers
from prefetch.restore import NO_SOURCE, TIMED_OUT, Restorer
from replicator.local_tier import frameworks
from replicator.local_tier.frameworks import orbax
from replicator.local_tier.job_keys import BusySteps
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import LogOnce
from replicator.local_tier.step_manifest import build_manifest
from replicator.peer_tier.service import add_peer_routes
from replicator.wire.bearer import Tokens
from replicator.wire.messages import JobRef, RestoreView, Source, Tier
from tests.helpers import REPO
from tests.helpers.steps import write_tree

MONITORING = REPO / "manifests" / "monitoring"
TOKEN = "peer-secret-restore-series"
NS, JOB, RANK, STEP = "default", "run", 1, 7
FILES = {orbax.COMMIT_EVIDENCE: b"{}", "state/manifest.ocdbt": os.urandom(50_000), "state/d/0a": os.urandom(20_000)}


def dashboard_target(ref_id: str) -> str:
    """The PromQL of the dashboard target ``ref_id``, with every job selected (Grafana's "All")."""
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    (expr,) = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"] if t["refId"] == ref_id]
    return expr.replace("$namespace", ".*").replace("$job", ".*")


def gauge(metric: str) -> float:
    """This process's sample of ``metric`` for the test's job."""
    return selected_total(
        metric, [m for _, ms in selectors(f'{metric}{{training_namespace="{NS}", training_job="{JOB}"}}') for m in ms]
    )


def selectors(expr: str) -> list[tuple[str, list]]:
    """(metric, matchers) of every vector selector in ``expr``."""
    found = []

    def walk(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, list(node.matchers.matchers)))
        elif isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, promql_parser.BinaryExpr):
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                walk(arg)
        elif hasattr(node, "expr"):  # aggregations, parentheses, unary minus, subqueries
            walk(node.expr)

    walk(promql_parser.parse(expr))
    return found


def matches(matcher, value: str) -> bool:
    if matcher.op == promql_parser.MatchOp.Equal:
        return value == matcher.value
    if matcher.op == promql_parser.MatchOp.NotEqual:
        return value != matcher.value
    found = re.fullmatch(matcher.value, value) is not None
    return found if matcher.op == promql_parser.MatchOp.Re else not found


def selected_total(metric: str, matchers: list) -> float:
    """The sum of this process's samples the selector picks (a missing label is the empty string)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(generate_latest(REGISTRY).decode())
        for sample in family.samples
        if sample.name == metric and all(matches(m, sample.labels.get(m.name, "")) for m in matchers)
    )


class PlanOfOneSource:
    """The coordinator's side of one restore: a view naming ``source``, ready once the rank staged."""

    def __init__(self, source: Source):
        self.source = source
        self.staged: list[str | None] = []

    async def restore_view(self, pod, seen=None, wait=None) -> RestoreView:
        return RestoreView("g1", STEP, (self.source,), ready=bool(self.staged))

    async def report_staged(self, pod, generation, source, bad, retrying=False) -> None:
        assert not bad, bad
        self.staged.append(source)


async def test_a_restore_from_a_close_peer_counts_in_the_dashboards_close_peer_series(tmp_path, monkeypatch):
    ((metric, matchers),) = selectors(dashboard_target("peer_close"))
    assert metric == "mtc_restore_seconds_count"

    # The holder: a node agent's peer service with rank 1's step 7 committed on its ramdisk.
    holder = JobMeta(str(tmp_path / "holder"))
    write_tree(os.path.join(holder.client_dir, str(STEP)), FILES)
    holder.save_manifest(build_manifest(os.path.join(holder.client_dir, str(STEP)), STEP, RANK))
    app = web.Application()
    add_peer_routes(
        app,
        lambda namespace, job: str(tmp_path / "holder") if (namespace, job) == (NS, JOB) else None,
        Tokens.of(TOKEN),
    )
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        # The restoring node: an empty ramdisk whose pod has rank 1.
        disk = Ramdisk(NS, JOB, 1 << 20, str(tmp_path / "restorer"))
        os.makedirs(disk.client_dir)
        meta = JobMeta(disk.path)
        plan = PlanOfOneSource(Source(Tier.PEER_CLOSE, "node-b", url, RANK, holder.manifests()[STEP].files))
        before = selected_total(metric, matchers)
        # The in-flight gauges as the fetch ends, still inside its transfer.
        in_flight, transfer = [], restore.RESTORE_IN_FLIGHT.transfer

        @contextlib.contextmanager
        def observed(namespace, job, total):
            with transfer(namespace, job, total) as fetched:
                yield fetched
                in_flight.append(
                    (gauge("mtc_restore_in_flight_planned_bytes"), gauge("mtc_restore_in_flight_fetched_bytes"))
                )

        monkeypatch.setattr(restore.RESTORE_IN_FLIGHT, "transfer", observed)
        async with aiohttp.ClientSession() as session:
            busy, asked = BusySteps(), time.monotonic()  # a report sent before the restore asked for its plan
            restorer = Restorer(
                stagers.for_node("node-a", Tokens.of(TOKEN), None, None),
                LogOnce(),
                deadline_seconds=30,
                busy_steps=busy,
            )
            await asyncio.wait_for(
                restorer.restore(plan, session, disk, meta, PodProgress("uid", "inc", RANK), lambda: None), 60
            )
    finally:
        await runner.cleanup()

    assert plan.staged == ["peer_close:node-b"]
    assert busy.restored_after(JobRef(NS, JOB), asked) == {STEP}  # an order answering that report keeps the step
    assert frameworks.get("orbax").scan_steps(disk.client_dir).staged == [STEP]  # staged from the peer, marker written
    assert selected_total(metric, matchers) - before == 1
    total = sum(len(data) for data in FILES.values())
    assert in_flight == [(total, total)]
    assert (gauge("mtc_restore_in_flight_planned_bytes"), gauge("mtc_restore_in_flight_fetched_bytes")) == (0, 0)


def test_every_restore_source_the_dashboard_and_rules_match_is_exported_from_the_jobs_publish():
    restore.seed_job_series("ns-seeded", "job-seeded")  # what the publish hook does (replicator.node.job_series)
    exported = {
        sample.labels["source"]
        for family in text_string_to_metric_families(generate_latest(REGISTRY).decode())
        for sample in family.samples
        if sample.name == "mtc_restore_seconds_count"
        and sample.value == 0
        and sample.labels["training_job"] == "job-seeded"
    }
    assert exported >= {*Tier, NO_SOURCE, TIMED_OUT}, (
        "every tier's series exists at zero before the job's first restore"
    )
    restore.forget_job_series("ns-seeded", "job-seeded")
    assert "job-seeded" not in generate_latest(REGISTRY).decode()
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    (rules,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [r["expr"] for group in rules["spec"]["groups"] for r in group["rules"]]
    matched = {
        m.value
        for expr in queries
        for metric, ms in selectors(expr)
        if metric.startswith("mtc_restore_seconds")
        for m in ms
        if m.name == "source" and m.op == promql_parser.MatchOp.Equal
    }
    assert matched == {*Tier, NO_SOURCE, TIMED_OUT}
    assert matched <= exported
