"""The coordinator scale bench's restart scenario, its own bookkeeping (tests/bench/coordinator_scale.py): which
deletions count as needed, how a failed report is named, the scenarios a run selects, and the verdicts it prints."""

import argparse
import collections

import pytest

from replicator.node.report_session import HeldCopy
from replicator.wire.coordinator_client import CoordinatorUnavailable
from tests.bench import coordinator_scale as bench


def _cluster() -> bench.SimCluster:
    return bench.SimCluster(None, "token", [bench.JobSpec("steady", 2, 4)])  # type: ignore[arg-type]


def test_a_step_is_needed_from_the_old_safe_step_on_and_while_its_upload_is_under_way():
    cluster = _cluster()
    key = cluster.agents[0].key
    cluster.bucket[key] = {200: {0, 1, 2, 3, 4, 5, 6, 7}, 300: {0, 1}}
    cluster.complete[key] = {200}
    assert cluster.needed(key, 400, 400) == "safe or newer"
    assert cluster.needed(key, 500, 400) == "safe or newer"
    assert cluster.needed(key, 300, 400) == "uploading"
    assert cluster.needed(key, 200, 400) is None  # the newest complete backup: the store holds it whole
    assert cluster.needed(key, 100, 400) is None


def test_deletions_are_recorded_from_the_kill_until_the_safe_step_advances():
    cluster = _cluster()
    agent = cluster.agents[0]
    cluster.note_deletions(agent, agent.key, [100], set())  # no restart watched: nothing recorded
    watch = cluster.stats.restart = bench.RestartWatch(0.0, 400)
    cluster.note_deletions(agent, agent.key, [300, 400], {HeldCopy(agent.key, 500, 3)})
    cluster.saw_safe(400)  # the old safe step again: no advance
    assert watch.advanced_at is None
    cluster.saw_safe(500)
    cluster.note_deletions(agent, agent.key, [400], set())  # ordered by the advanced safe step: not counted
    assert watch.new_safe == 500
    assert sorted(watch.deletions) == [
        (agent.node_id, 300, "own", None),
        (agent.node_id, 400, "own", "safe or newer"),
        (agent.node_id, 500, "replica", "safe or newer"),
    ]


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("POST /v1/report: TimeoutError()", "TimeoutError"),
        ("POST /v1/report: ServerDisconnectedError('Server disconnected')", "ServerDisconnectedError"),
        ("POST /v1/report: HTTP 503: {'error': 'busy'}", "HTTP 503"),
    ],
)
def test_a_failed_report_is_named_by_the_clients_error(message, kind):
    assert bench.failure_kind(CoordinatorUnavailable(message)) == kind


def test_scenarios_are_named_from_the_list_and_anything_else_is_refused():
    assert bench.scenario_list("restart") == ("restart",)
    assert bench.scenario_list("steady, restart") == ("steady", "restart")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown scenario bogus"):
        bench.scenario_list("steady,bogus")


def _restart_figures(deletions) -> dict:
    return {
        "answered_seconds": 12.0,
        "answered_nodes": 1000,
        "up_seconds": 1.0,
        "failures": collections.Counter({"TimeoutError": 3}),
        "listen_overflows": 0,
        "safe_seconds": 31.0,
        "old_safe": 300,
        "new_safe": 400,
        "complete_seconds": 2.0,
        "deletions": deletions,
        "newest_backup": 200,
        "coordinator_cpu": 50.0,
        "coordinator_rss": 2**27,
        "coordinator_peak_rss": 2**27,
        "coordinator_idle_rss": 2**26,
        "generator_cpu": 40.0,
        "loop_lag_p99": 0.1,
        "heartbeat_seconds": 1.0,
    }


def test_the_restart_rows_judge_each_goal():
    rows = {r[0]: r for r in bench.restart_rows(1000, _restart_figures([("node-0", 100, "own", None)]))}
    assert rows["restart: SIGKILL -> every node answered"][3] is True
    assert rows["restart: SIGKILL -> safe step advanced"][3] is False  # 31 s against 30
    assert rows["restart: needed steps deleted meanwhile"][3] is True  # an old step's deletion is not a needed one
    assert "3 TimeoutError" in rows["restart: SIGKILL -> every node answered"][1]
    needed = bench.restart_rows(1000, _restart_figures([("node-0", 300, "own", "safe or newer")]))
    assert {r[0]: r[3] for r in needed}["restart: needed steps deleted meanwhile"] is False
