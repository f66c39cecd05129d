"""The Grafana dashboard and the alert rules use only metrics and labels that exist.

A real coordinator and real node agents (``examples/local_cluster.py``) serve a hand-driven job
through the Orbax protocol, replication and a ``file://`` backup; their ``/metrics`` are scraped
and every metric and label the dashboard's queries, legends and variables and the rules'
expressions and annotations name must be there, with the labels Prometheus adds to each target.
No metric may carry a label Prometheus sets on its target (the scrape needs no ``honorLabels``).
Every alert links a runbook section that exists in docs/, and the alerts the coordinator's outage
causes are held back while it is down. PromQL is parsed with PyPI ``promql-parser`` (Prometheus's
``promtool`` cannot be ``go install``ed; see docs/operations.md, Monitoring).
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
from tests.helpers.markdown import anchors, slug
from tests.helpers.polling import wait_until
from tests.helpers.steps import commit_step
from tests.helpers.tools import requires_root

MONITORING = REPO / "manifests" / "monitoring"
DOCS = REPO / "docs"
RUNBOOK_BASE = "https://github.com/mtc-dev/mtc/blob/main/docs/"
# Labels the Prometheus Operator gives every target of a ServiceMonitor (job: the Service's name).
TARGET_LABELS = {"instance", "job", "namespace", "service", "pod", "container", "endpoint"}
# Series the rules read from elsewhere: Prometheus's own, and kube-state-metrics' (with their labels).
EXTERNAL = {"up": TARGET_LABELS, "kube_node_info": {"node"}, "kube_node_spec_unschedulable": {"node"}}
COORDINATOR_DOWN = 'absent(up{job="mtc-coordinator",namespace="mtc-system"} == 1)'


def target_labels(service_monitor: str) -> set[str]:
    """The labels Prometheus puts on every series the ServiceMonitor scrapes: the operator's, and
    what its relabelings set."""
    (monitor,) = [
        d
        for d in yaml.safe_load_all((MONITORING / "servicemonitors.yaml").read_text())
        if d["kind"] == "ServiceMonitor" and d["metadata"]["name"] == service_monitor
    ]
    return TARGET_LABELS | {r["targetLabel"] for e in monitor["spec"]["endpoints"] for r in e.get("relabelings", [])}


def alert_rules() -> list[dict]:
    (rule,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def dashboard_queries() -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels its legend names) of every dashboard target."""
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    return [
        (
            f"panel {panel['title']!r} {target['refId']}",
            target["expr"],
            set(re.findall(r"{{\s*(\w+)\s*}}", target.get("legendFormat", ""))),
        )
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
    return [
        (
            f"alert {r['alert']}",
            r["expr"],
            set(re.findall(r"\$labels\.(\w+)", " ".join(r.get("annotations", {}).values()))),
        )
        for r in alert_rules()
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
    """What ``queries`` reference that ``exported`` (metric -> label names, as Prometheus stores
    them) does not have."""
    found = []
    for where, expr, output_labels in queries:
        used = selectors(expr)
        for metric, labels in used:
            if metric not in exported:
                found.append(f"{where}: no metric {metric}")
            elif missing := labels - exported[metric] - {"__name__"}:
                found.append(f"{where}: {metric} has no label {sorted(missing)}")
        available = set().union(*(exported.get(m, set()) for m, _ in used))
        if missing := output_labels - available:
            found.append(f"{where}: legend or annotation names {sorted(missing)}, which no series of it has")
    return found


def exported_series(text: str, scrape_labels: set[str]) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry in Prometheus: their own and ``scrape_labels``.

    Raises:
      AssertionError: a sample carries a label of ``scrape_labels`` itself: Prometheus would rename
        it ``exported_<label>`` (or, with honorLabels, overwrite the target's).
    """
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            clash = set(sample.labels) & scrape_labels
            assert not clash, f"{sample.name} carries {sorted(clash)}, which Prometheus sets on its target"
            exported.setdefault(sample.name, set()).update(sample.labels, scrape_labels)
    return exported


def merged(*pages: dict[str, set[str]]) -> dict[str, set[str]]:
    exported: dict[str, set[str]] = {}
    for page in (EXTERNAL, *pages):
        for name, labels in page.items():
            exported.setdefault(name, set()).update(labels)
    return exported


def test_every_query_is_valid_promql():
    for where, expr, _ in dashboard_queries() + rule_queries():
        try:
            promql_parser.parse(expr)
        except ValueError as err:
            pytest.fail(f"{where}: {err}: {expr}")


def test_dashboard_and_rules_cover_what_operators_need():
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    assert len(dashboard["panels"]) >= 20
    stats = {p["title"] for p in dashboard["panels"] if p["type"] == "stat"}
    assert {
        "Coordinator up",
        "Live / silent nodes",
        "Coordinator loop lag p99",
        "Newest safe step",
        "Backup age",
    } <= stats
    alerts = {where.removeprefix("alert ") for where, _, _ in rule_queries()}
    assert alerts == {
        "MTCCoordinatorDown",
        "MTCBackupBehind",
        "MTCBackupStoreUnusable",
        "MTCCorruptCopy",
        "MTCSlowRestore",
        "MTCRestoreWaitingForRanks",
        "MTCNodeSilent",
        "MTCNodeDrained",
        "MTCNodeCannotReport",
        "MTCRamdiskNearlyFull",
        "MTCReplicatorLoopErrors",
        "MTCRefusedStep",
        "MTCUntrustedClaims",
    }
    assert "node" in target_labels("mtc-node"), "panels group by node: the agents' ServiceMonitor must set it"
    assert "node" not in target_labels("mtc-coordinator"), "the coordinator's own node label names a silent node"


def test_the_dashboard_draws_no_line_per_node():
    # At 1,000 nodes a line per node is unreadable: per-node queries are top-10 tables.
    dashboard = json.loads((MONITORING / "mtc-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            per_node = re.search(r"{{\s*node\s*}}", target.get("legendFormat", "")) or re.search(
                r"by \([^)]*\bnode\b", target["expr"]
            )
            if per_node:
                assert panel["type"] == "table" and target["expr"].startswith("topk(10,"), (
                    f"{panel['title']}: {target['expr']}"
                )


def test_no_scrape_config_needs_honor_labels():
    for doc in yaml.safe_load_all((MONITORING / "servicemonitors.yaml").read_text()):
        for endpoint in doc["spec"].get("endpoints", []):
            assert "honorLabels" not in endpoint, doc["metadata"]["name"]
    with pytest.raises(AssertionError, match=r"mtc_x carries \['job'\]"):
        exported_series('mtc_x{job="train"} 1.0\n', TARGET_LABELS)


def test_every_alert_links_a_runbook_section_that_exists():
    pages = {path.name: anchors(path) for path in DOCS.glob("*.md")}
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(RUNBOOK_BASE), f"{rule['alert']}: runbook_url {url!r} is not under {RUNBOOK_BASE}"
        page, _, anchor = url.removeprefix(RUNBOOK_BASE).partition("#")
        assert page in pages and anchor in pages[page], f"{rule['alert']}: no heading #{anchor} in docs/{page}"
        assert anchor == rule["alert"].lower()


def test_a_runbook_anchor_is_githubs():
    assert slug("MTCNodeSilent") == "mtcnodesilent"
    assert slug("Roll back: `mtc restore-from`, step 1.5!") == "roll-back-mtc-restore-from-step-15"


def test_alerts_the_coordinators_outage_causes_are_held_back_while_it_is_down():
    rules = {r["alert"]: r for r in alert_rules()}
    assert (
        promql_parser.parse(rules["MTCCoordinatorDown"]["expr"]).prettify()
        == promql_parser.parse(COORDINATOR_DOWN).prettify()
    )
    held = set()
    for name, rule in rules.items():
        tree = promql_parser.parse(rule["expr"])
        if isinstance(tree, promql_parser.BinaryExpr) and str(tree.op) == "unless":
            assert (
                tree.modifier.matching.labels == []
                and tree.modifier.matching.type == promql_parser.LabelModifierType.Include
            ), name  # on ()
            assert tree.rhs.prettify() == promql_parser.parse(COORDINATOR_DOWN).prettify(), name
            held.add(name)
    assert held == {
        "MTCNodeCannotReport",
        "MTCNodeSilent",
        "MTCNodeDrained",
        "MTCBackupBehind",
        "MTCSlowRestore",
        "MTCRestoreWaitingForRanks",
    }
    # The chart's optional Alertmanager inhibit rule holds back the same alerts.
    values = yaml.safe_load((REPO / "charts" / "mtc" / "values.yaml").read_text())
    assert set(values["monitoring"]["alertmanagerConfig"]["inhibitedAlerts"]) == held
    inhibit_example = (DOCS / "troubleshooting.md").read_text().split("inhibit_rules:")[1].split("```")[0]
    assert all(name in inhibit_example for name in held)


def test_alerts_name_what_they_are_about():
    for rule in alert_rules():
        named = set(re.findall(r"\$labels\.(\w+)", rule["annotations"]["summary"]))
        if rule["alert"] not in ("MTCCoordinatorDown", "MTCUntrustedClaims"):  # the cluster's, no node or job
            # A backup store's fault is the store's (one alert per store, not one per node).
            assert named & {"node", "training_job", "store"}, (
                f"{rule['alert']}: its summary names no node, job or store"
            )
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["labels"]["namespace"] == "mtc-system"


def test_the_store_alert_counts_the_agents_whose_probe_failed_per_store():
    # The gauge is 0 while a store fails the agent's probe and absent without --backup (store_check.py): the
    # alert selects the 0s only and keeps the store's label.
    (rule,) = [r for r in alert_rules() if r["alert"] == "MTCBackupStoreUnusable"]
    tree = promql_parser.parse(rule["expr"])
    assert isinstance(tree, promql_parser.AggregateExpr) and str(tree.op) == "count"
    assert tree.modifier.labels == ["store"]
    compared = tree.expr
    assert str(compared.op) == "==" and compared.rhs.prettify() == "0"
    assert selectors(rule["expr"]) == [("mtc_backup_store_usable", {"store"})]
    assert (rule["for"], rule["labels"]["severity"]) == ("2m", "warning")  # past the first recheck, 60 s on


def test_reference_check_catches_a_missing_metric_and_label():
    exported = {"mtc_live_nodes": set(), "mtc_restore_seconds_bucket": {"le", "source"}}
    queries = [
        ("a", "max(mtc_live_nodes)", set()),
        ("b", "sum by (le, tier) (rate(mtc_restore_seconds_bucket[5m]))", set()),
        ("c", "mtc_no_such_metric", set()),
        ("d", "max(mtc_live_nodes)", {"job"}),
    ]
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
    cluster = start_cluster(nodes=3, backup=f"file://{tmp_path / 'store'}")
    agents, idle = cluster.agents[:2], cluster.agents[2]
    # Job "mon": 2 ranks, replicated to each other, backed up every step.
    attrs = {"nodes": "2", "slices": "1", "size": "32Mi", "jobset": "mon"}
    targets = [_publish(agent, tmp_path, f"mon-slice-0-{i}-a", attrs) for i, agent in enumerate(agents)]
    # Job "hourly": one rank, backup-interval-minutes (the other interval gauge).
    hourly = _publish(
        agents[0], tmp_path, "hourly-slice-0-0-a", {"nodes": "1", "slices": "1", "size": "8Mi", "jobset": "hourly"}
    )
    start_fresh(targets, "mon", nodes=2, backup_interval_steps=1)
    start_fresh([hourly], "hourly", nodes=1, backup_interval_minutes=60)
    for target in targets:
        commit_step(target, 4, {"state/data": os.urandom(256 * 1024), "_CHECKPOINT_METADATA": b"{}"})

    coordinator = cluster.coordinator

    def backed_up() -> bool:
        (job,) = coordinator.status("mon-slice")["jobs"]
        return 4 in job["backups"] and "mtc_last_backup_timestamp_seconds{" in scrape(
            coordinator.url, coordinator.ssl_context()
        )

    wait_until(backed_up, 60, "step 4 backed up")
    wait_until(
        lambda: any("mtc_replicated_bytes_total 0.0" not in scrape(a.url) for a in agents), 30, "a replica pushed"
    )
    # A node lost: the coordinator lists it as silent (node timeout 4 s) until it forgets it.
    cluster.lose_node(idle)
    wait_until(
        lambda: (
            f'mtc_node_silent_seconds{{node="{idle.node_id}"}}' in scrape(coordinator.url, coordinator.ssl_context())
        ),
        30,
        "the lost node silent",
    )

    page = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(scrape(coordinator.url, coordinator.ssl_context()))
        for s in f.samples
    }
    assert page[("mtc_silent_nodes", ())] == 1 and page[("mtc_live_nodes", ())] == 2
    assert page[("mtc_node_silent_seconds", (("node", idle.node_id),))] > 4  # past the node timeout
    mon = (("training_job", "mon-slice"), ("training_namespace", "default"))
    assert page[("mtc_restore_ranks", mon)] == page[("mtc_restore_ranks_staged", mon)] == 2  # both ranks started fresh
    exported = merged(
        exported_series(scrape(coordinator.url, coordinator.ssl_context()), target_labels("mtc-coordinator")),
        *(exported_series(scrape(a.url), target_labels("mtc-node")) for a in agents),
    )
    assert problems(dashboard_queries() + rule_queries(), exported) == []
    for metric, label in dashboard_variables():
        assert label in exported.get(metric, set()), f"variable label_values({metric}, {label})"
