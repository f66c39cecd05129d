"""What ``mtc status`` and ``mtc restore-from`` get from the coordinator: the on-call fields of the
status, a rollback's preview, its cancellation until it is planned, and that a cancelled rollback
leaves the job as if it had never been asked for. The state is driven by hand-built reports; the
routes run over real HTTP (aiohttp's test server)."""

import asyncio
import time

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from replicator.cli import main
from replicator.coordinator.api import routes, service
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.status import render_preview, render_status
from replicator.coordinator.planning.rollbacks import NotCancellable
from replicator.coordinator.state import ClusterState, UnknownJob
from replicator.wire.messages import BackedUp, HeldStep, decode_json
from replicator.wire.operator import ClusterStatus, RollbackPreview
from tests.helpers.coordinator import KEY, NAMES, OWN, held_by, pod, report, running_job

JOB_PATH = f"/v1/jobs/{KEY.namespace}/{KEY.job}"


def holding(state, rank_of, steps, now, incarnation=None, pods=True, listing=None):
    """Nodes a and b report their own copies of ``steps`` besides step 5 and its replicas (with their
    pods unless ``pods`` is false); node a lists the ``listing`` backups."""
    for index, node in enumerate(("a", "b")):
        held = [HeldStep(*NAMES, s, rank_of[node], OWN[rank_of[node]]) for s in steps] + held_by(node, rank_of)
        pods_ = [pod(index, incarnation, rank_of[node])] if pods else []
        backed = (BackedUp(*NAMES, tuple((s, 0) for s in listing), now),) if listing and node == "a" else ()
        state.apply_report(
            msgspec.structs.replace(
                report(node, f"http://{node}", pods_, held), has_backup=bool(listing), backed_up=backed
            ),
            now,
        )


def test_a_cancelled_rollback_leaves_the_job_as_if_it_was_never_requested():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    holding(state, rank_of, (2,), 21.0, incarnation)  # the job runs; its nodes hold steps 2 and 5
    state.tick(22.0)
    retain = state.job(KEY).retain
    assert retain is not None and state.reply_for("a").retain == (retain,)

    preview = state.operator.preview(KEY, 2)
    assert [(s.step, s.local, s.peer, s.backup) for s in preview.abandoned] == [
        (5, {rank_of["a"]: ("a",), rank_of["b"]: ("b",)}, {rank_of["b"]: ("a",), rank_of["a"]: ("b",)}, False)
    ]
    assert (preview.ranks, preview.timeline, preview.pending_rollback) == (2, 1, None)
    assert state.job(KEY).forced_step is None and state.job(KEY).retain == retain  # a preview changes nothing

    state.operator.force(KEY, 2)
    assert state.reply_for("a").retain == ()  # at once: nothing is deleted while it is pending
    assert state.operator.status().jobs[0].pending_rollback == 2
    assert state.operator.preview(KEY, 2).pending_rollback == 2
    assert state.operator.cancel(KEY) == 2
    assert state.reply_for("a").retain == (retain,) and state.job(KEY).forks == ()
    assert (state.operator.status().jobs[0].pending_rollback, state.operator.status().jobs[0].forced_step) == (
        None,
        None,
    )
    with pytest.raises(NotCancellable, match="no pending rollback"):
        state.operator.cancel(KEY)

    # The next incarnation restores the newest step, on the same timeline: nothing was abandoned.
    holding(state, rank_of, (2,), 22.5, pods=False)
    for index, node in enumerate(("a", "b")):
        state.apply_report(
            report(node, f"http://{node}", [pod(index + 2)], state.liveness.nodes[node].report.held), 23.0
        )
    fresh = state.job(KEY).incarnation.incarnation_id
    view = state.restore.view(KEY, fresh, 0, now=23.5)
    assert (view.step, view.rollback, view.forks) == (5, False, ())
    assert {c.step for c in state.copies(KEY)} == {2, 5}


def test_a_rollback_whose_restore_is_planned_cannot_be_cancelled():
    state = ClusterState()
    state.expire(0.0)
    _, rank_of = running_job(state, now=20.0)
    holding(state, rank_of, (2,), 21.0, pods=False)
    state.operator.force(KEY, 2)
    for index, node in enumerate(("a", "b")):
        state.apply_report(
            report(node, f"http://{node}", [pod(index + 2)], state.liveness.nodes[node].report.held), 22.0
        )
    assert state.restore.view(KEY, state.job(KEY).incarnation.incarnation_id, 0, now=22.5).step == 2
    with pytest.raises(NotCancellable, match="step 2 cannot be cancelled: its restore is planned and timeline 1 began"):
        state.operator.cancel(KEY)
    assert (state.job(KEY).forced_step, state.job(KEY).forks) == (2, (2,))
    with pytest.raises(UnknownJob):
        state.operator.cancel(msgspec.structs.replace(KEY, job="nope"))


def test_a_pending_rollback_step_is_kept_from_backup_retention_until_cancelled():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0, has_backup=True)
    holding(state, rank_of, (), 21.0, incarnation, listing=(2,))  # step 2 is only in the backup tier
    state.tick(22.0)
    assert state.job(KEY).backup_pending == 5
    assert {o.protected for o in state.reply_for("a").backup} == {()}
    state.operator.force(KEY, 2)
    assert {o.protected for o in state.reply_for("a").backup} == {
        (2,)
    }  # retention keeps it though it is not the newest
    state.operator.cancel(KEY)
    assert {o.protected for o in state.reply_for("a").backup} == {()}


def serve(scenario, token_file=None):
    async def run():
        app = service.make_app(CoordinatorConfig("127.0.0.1:0", token_file=token_file))
        state = app[routes.STATE_KEY]
        now = time.time()
        state.expire(now - 100.0)  # started long ago: plans need not wait for reports
        incarnation, rank_of = running_job(state, now=now, has_backup=True)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client, state, incarnation, rank_of, now)

    return asyncio.run(run())


def test_status_shows_silent_nodes_pending_rollback_last_backup_restore_progress_and_unusable_copies():
    async def scenario(client, state, incarnation, rank_of, now):
        holding(state, rank_of, (), now, incarnation, listing=(5,))
        state.tick(now + 0.1)
        view = await (
            await client.get(f"{JOB_PATH}/restore", params={"incarnation": incarnation, "rank": str(rank_of["a"])})
        ).json()
        await client.post(
            f"{JOB_PATH}/restore",
            json={
                "incarnation": incarnation,
                "generation": view["generation"],
                "rank": rank_of["a"],
                "source": "local:a",
                "bad": [[5, rank_of["a"], "b"]],
            },
        )
        assert (await client.post(f"{JOB_PATH}/restore-from", json={"step": 5})).status == 200
        state.touch("a", now + 20.0)  # node b has been silent for 20 s (timeout 15 s)
        response = await client.get("/v1/status", params={"job": str(KEY)})
        return response.status, await response.read()

    code, raw = serve(scenario)
    assert code == 200
    status = decode_json(raw, ClusterStatus)
    (job,) = status.jobs
    b_rank = next(p.rank for p in job.ranks if p.node == "b")
    assert status.silent_nodes == ("b",) and job.silent_nodes == {"b": 20.0}
    assert [(p.node, p.silent) for p in job.ranks if p.rank == b_rank] == [("b", True)]
    assert job.pending_rollback == 5
    assert job.last_backup_step == 5 and 0.0 <= job.last_backup_age_seconds < 30.0
    assert (job.restore.step, job.restore.staged_ranks, job.restore.ranks) == (5, 1, 2)
    assert [(c.rank, c.step, c.holder) for c in job.restore.unusable_copies] == [(1 - b_rank, 5, "b")]
    table = render_status(status)
    assert "nodes: 1 live, 1 silent: b" in table
    assert f"job {KEY}  incarnation {job.incarnation}  ranks 2 (1 on silent nodes)" in table
    assert "restore: step 5, 1/2 ranks staged (in progress)" in table
    assert f"unusable copies (1): rank {1 - b_rank} step 5 on b" in table
    assert "PENDING ROLLBACK to step 5" in table and "SILENT NODES (1): b (20 s)" in table
    assert "last backup: step 5, " in table
    assert any(line.startswith(f"  ! {b_rank:>5}  b SILENT") for line in table.splitlines())


@pytest.mark.parametrize(
    ("query", "code", "error"),
    [
        ("default/nope", 404, "no job default/nope"),
        ("nope", 404, "no job named 'nope'"),
        ("a/b/c", 400, "NAMESPACE/JOB"),
    ],
)
def test_status_of_an_unknown_or_malformed_job_is_an_error(query, code, error):
    async def scenario(client, state, incarnation, rank_of, now):
        response = await client.get("/v1/status", params={"job": query})
        return response.status, await response.json()

    status, body = serve(scenario)
    assert status == code and error in body["error"]


def test_the_rollback_routes_preview_request_and_cancel(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    auth = {"Authorization": "Bearer s3cret"}

    async def scenario(client, state, incarnation, rank_of, now):
        holding(state, rank_of, (6,), now, incarnation, listing=(5, 6))
        state.tick(now + 0.1)
        answers = {}
        for name, method, path, kwargs in [
            ("preview", "GET", JOB_PATH + "/restore-from?step=5", {}),
            ("incomplete", "GET", JOB_PATH + "/restore-from?step=4", {}),
            ("malformed", "GET", JOB_PATH + "/restore-from?step=-1", {}),
            ("unknown", "GET", "/v1/jobs/default/nope/restore-from?step=5", {}),
            ("nothing pending", "DELETE", JOB_PATH + "/restore-from", {"headers": auth}),
            ("request", "POST", JOB_PATH + "/restore-from", {"headers": auth, "json": {"step": 5}}),
            ("unknown request", "POST", "/v1/jobs/default/nope/restore-from", {"headers": auth, "json": {"step": 5}}),
            ("cancel without token", "DELETE", JOB_PATH + "/restore-from", {}),
            ("cancel", "DELETE", JOB_PATH + "/restore-from", {"headers": auth}),
        ]:
            response = await client.request(method, path, **kwargs)
            answers[name] = (response.status, await response.read())
            if name == "preview":
                assert state.job(KEY).forced_step is None and state.job(KEY).retain is not None  # changed nothing
        return answers, state.job(KEY).forced_step, state.job(KEY).forks

    answers, forced, forks = serve(scenario, str(token))
    code, raw = answers["preview"]
    preview = decode_json(raw, RollbackPreview)
    assert code == 200 and [(s.step, sorted(s.local), s.backup) for s in preview.abandoned] == [(6, [0, 1], True)]
    text = render_preview(preview)
    assert "step 6: local 2/2 ranks on 2 nodes; peer -; backup yes" in text and "timeline 1 begins" in text
    expected = {
        "incomplete": (409, "step 4"),
        "malformed": (400, "step"),
        "unknown": (404, "no job default/nope"),
        "nothing pending": (409, "no pending rollback"),
        "request": (200, '"step":5'),
        "unknown request": (404, "no job"),
        "cancel without token": (401, "bearer"),
        "cancel": (200, '"step":5'),
    }
    for name, (code, text) in expected.items():
        assert answers[name][0] == code and text in answers[name][1].decode(), (name, answers[name])
    assert (forced, forks) == (None, ())


def test_restore_from_without_a_terminal_or_yes_is_refused_before_asking_anything(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    argv = ["restore-from", "--coordinator", "http://127.0.0.1:9", "--job", "default/run", "--step", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err == "mtc restore-from: no terminal to confirm on: pass --yes (or --dry-run to only see what it abandons)\n"
    )
    assert main([*argv, "--cancel"]) == 2
    assert "give --step S to roll back, or --cancel" in capsys.readouterr().err


def test_restore_from_on_a_terminal_rolls_back_only_on_a_typed_yes(capsys, monkeypatch):
    async def scenario(client, state, incarnation, rank_of, now):
        url = str(client.make_url("")).rstrip("/")
        argv = ["restore-from", "--coordinator", url, "--job", str(KEY), "--step", "5"]
        monkeypatch.setattr("sys.stdin.isatty", lambda: True)
        results = []
        for answer in ("y", "yes"):
            monkeypatch.setattr("builtins.input", lambda prompt: answer)
            results.append((await asyncio.to_thread(main, argv), state.job(KEY).forced_step))
        return results

    assert serve(scenario) == [(1, None), (0, 5)]
    out = capsys.readouterr()
    assert "not rolled back" in out.err and "default/run will restore step 5" in out.out


def test_a_rollback_to_copies_this_incarnation_proved_unusable_is_refused():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0, has_backup=True)
    holding(state, rank_of, (), 21.0, incarnation, listing=(2,))  # step 2 is only in the backup tier
    state.tick(22.0)
    # The incarnation's restore found rank 0's backup of step 2 corrupt (what report_staged records).
    state.job(KEY).incarnation.excluded.add((2, 0, "backup"))
    with pytest.raises(
        LookupError,
        match=r"step 2 of default/run is not complete for every rank in any tier \(copies of it were found unusable\)",
    ):
        state.operator.force(KEY, 2)
    assert state.job(KEY).forced_step is None


def test_a_rollback_with_nothing_restorable_at_or_before_its_step_is_dropped_not_a_fresh_start():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0, has_backup=True)
    holding(state, rank_of, (), 21.0, incarnation, listing=(2,))
    state.operator.force(KEY, 2)
    holding(state, rank_of, (), 22.0, pods=False, listing=(5,))  # the backup of step 2 is gone before the restore
    for index, node in enumerate(("a", "b")):
        state.apply_report(
            msgspec.structs.replace(
                report(node, f"http://{node}", [pod(index + 2)], state.liveness.nodes[node].report.held),
                has_backup=True,
                backed_up=state.liveness.nodes[node].report.backed_up,
            ),
            23.0,
        )
    view = state.restore.view(KEY, state.job(KEY).incarnation.incarnation_id, 0, now=23.5)
    assert (view.step, view.rollback, view.forks) == (5, False, ())  # the newest step, on the same timeline
    assert (state.job(KEY).forced_step, state.job(KEY).forks) == (None, ())
