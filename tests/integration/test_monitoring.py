"""The Grafana dashboard and the alert rules use only metrics and labels that exist.

A real coordinator and real node agents (``examples/local_cluster.py``) serve a hand-driven job
through the Orbax protocol, replication and a ``file://`` backup; their ``/metrics`` are scraped
and every metric and label the dashboard's queries, legends and variables and the rules'
expressions and annotations name must be there. PromQL is parsed with PyPI ``promql-parser``
(Prometheus's ``promtool`` cannot be ``go install``ed; see docs/operations.md, Monitoring).
"""

import json
import os
import re
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from csi_driver import kubelet
from tests.helpers import REPO
from tests.helpers.agents import scrape, start_fresh
from tests.helpers.polling import wait_until
from tests.helpers.steps import commit_step
from tests.helpers.tools import requires_root

MONITORING = REPO / "manifests" / "monitoring"
# Labels Prometheus adds to every scraped series: `instance`, and what the ServiceMonitors relabel.
SCRAPE_LABELS = {"instance"} | {
    relabel["targetLabel"]
    for doc in yaml.safe_load_all((MONITORING / "servicemonitors.yaml").read_text())
    if doc["kind"] == "ServiceMonitor"
    for endpoint in doc["spec"]["endpoints"]
    for relabel in endpoint.get("relabelings", [])
}


def dashboard_queries() -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels its legend names) of every dashboard target."""
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    return [
        (f"panel {panel['title']!r} {target['refId']}", target["expr"], set(re.findall(r"{{\s*(\w+)\s*}}", target.get("legendFormat", ""))))
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def dashboard_variables() -> list[tuple[str, str]]:
    """(metric, label) of every ``label_values(metric, label)`` variable."""
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            (match,) = re.findall(r"label_values\((\w+),\s*(\w+)\)", variable["definition"])
            found.append(match)
    return found


def rule_queries() -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels its annotations name) of every alert."""
    (rule,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    return [
        (f"alert {r['alert']}", r["expr"], set(re.findall(r"\$labels\.(\w+)", " ".join(r.get("annotations", {}).values()))))
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    ]


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, labels it must carry) of every selector in ``expr``: its own matchers, plus the
    ``by`` and ``on``/``group_*`` labels of the aggregations and operations above it.

    Raises:
      ValueError: ``expr`` is not valid PromQL.
    """
    found: list[tuple[str, set[str]]] = []

    def walk(node, required: frozenset) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, {m.name for m in node.matchers.matchers} | required))
        elif isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector, required)
        elif isinstance(node, promql_parser.AggregateExpr):
            by = node.modifier is not None and node.modifier.type == promql_parser.AggModifierType.By
            walk(node.expr, required | frozenset(node.modifier.labels if by else ()))
        elif isinstance(node, promql_parser.BinaryExpr):
            labels = set()
            if node.modifier is not None:
                labels |= set(node.modifier.group_labels or ())
                matching = node.modifier.matching
                if matching is not None and matching.type == promql_parser.LabelModifierType.Include:
                    labels |= set(matching.labels)
            walk(node.lhs, required | labels)
            walk(node.rhs, required | labels)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                walk(arg, required)
        elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            walk(node.expr, required)

    walk(promql_parser.parse(expr), frozenset())
    return found


def problems(queries: list[tuple[str, str, set[str]]], exported: dict[str, set[str]]) -> list[str]:
    """What ``queries`` reference that ``exported`` (metric -> label names) does not have."""
    found = []
    for where, expr, output_labels in queries:
        used = selectors(expr)
        for metric, labels in used:
            if metric not in exported:
                found.append(f"{where}: no metric {metric}")
            elif missing := labels - exported[metric] - SCRAPE_LABELS - {"__name__"}:
                found.append(f"{where}: {metric} has no label {sorted(missing)}")
        available = set().union(*(exported.get(m, set()) for m, _ in used)) | SCRAPE_LABELS
        if missing := output_labels - available:
            found.append(f"{where}: legend or annotation names {sorted(missing)}, which no series of it has")
    return found


def exported_series(*texts: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, over several ``/metrics`` pages."""
    exported: dict[str, set[str]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def test_every_query_is_valid_promql():
    for where, expr, _ in dashboard_queries() + rule_queries():
        try:
            promql_parser.parse(expr)
        except ValueError as err:
            pytest.fail(f"{where}: {err}: {expr}")


def test_dashboard_and_rules_cover_what_operators_need():
    titles = {where.split("'")[1] for where, _, _ in dashboard_queries()}
    assert len(titles) >= 10
    alerts = {where.removeprefix("alert ") for where, _, _ in rule_queries()}
    assert alerts == {"MTCBackupBehind", "MTCCorruptCopy", "MTCSlowRestore", "MTCNodeSilent", "MTCNodeCannotReport",
                      "MTCRamdiskNearlyFull", "MTCReplicatorLoopErrors", "MTCRefusedStep", "MTCUntrustedClaims"}  # fmt: skip
    assert "node" in SCRAPE_LABELS, "panels group by node: the ServiceMonitors must set it"


def test_reference_check_catches_a_missing_metric_and_label():
    exported = {"mtc_live_nodes": set(), "mtc_restore_seconds_bucket": {"le", "source"}}
    queries = [("a", "max(mtc_live_nodes)", set()), ("b", "sum by (le, tier) (rate(mtc_restore_seconds_bucket[5m]))", set()),
               ("c", "mtc_no_such_metric", set()), ("d", "max(mtc_live_nodes)", {"job"})]  # fmt: skip
    assert problems(queries, exported) == [
        "b: mtc_restore_seconds_bucket has no label ['tier']",
        "c: no metric mtc_no_such_metric",
        "d: legend or annotation names ['job'], which no series of it has",
    ]


def _publish(agent, tmp_path, pod: str, attrs: dict) -> Path:
    target = tmp_path / "pods" / pod / "mount"
    kubelet.publish(agent.endpoint, str(target), pod, attributes=attrs)
    return target


@requires_root
def test_every_metric_and_label_the_dashboard_and_rules_use_is_exported(start_cluster, tmp_path):
    cluster = start_cluster(nodes=2, backup=f"file://{tmp_path / 'store'}")
    agents = cluster.agents
    # Job "mon": 2 ranks, replicated to each other, backed up every step.
    attrs = {"nodes": "2", "slices": "1", "size": "32Mi", "jobset": "mon"}
    targets = [_publish(agent, tmp_path, f"mon-slice-0-{i}-a", attrs) for i, agent in enumerate(agents)]
    # Job "hourly": one rank, backup-interval-minutes (the other interval gauge).
    hourly = _publish(agents[0], tmp_path, "hourly-slice-0-0-a", {"nodes": "1", "slices": "1", "size": "8Mi", "jobset": "hourly"})
    start_fresh(targets, "mon", nodes=2, backup_interval_steps=1)
    start_fresh([hourly], "hourly", nodes=1, backup_interval_minutes=60)
    for target in targets:
        commit_step(target, 4, {"state/data": os.urandom(256 * 1024), "_CHECKPOINT_METADATA": b"{}"})

    coordinator = cluster.coordinator

    def backed_up() -> bool:
        (job,) = coordinator.status("mon-slice")["jobs"]
        return 4 in job["backups"] and "mtc_last_backup_timestamp_seconds{" in scrape(coordinator.url, coordinator.ssl_context())

    wait_until(backed_up, 60, "step 4 backed up")
    wait_until(lambda: any("mtc_replicated_bytes_total 0.0" not in scrape(a.url) for a in agents), 30, "a replica pushed")

    exported = exported_series(scrape(coordinator.url, coordinator.ssl_context()), *(scrape(a.url) for a in agents))
    assert problems(dashboard_queries() + rule_queries(), exported) == []
    for metric, label in dashboard_variables():
        assert label in exported.get(metric, set()), f"variable label_values({metric}, {label})"
