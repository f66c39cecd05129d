"""The coordinator's typed routes over real HTTP (aiohttp's test server): bodies decode at the edge
into ``messages`` structs, a bad one is a 400 whose error names the field, and the JSON field names
stay what ``mtc`` clients of earlier releases send and read."""

import asyncio
import time

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from replicator.coordinator.api import routes, service
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.status import render_status
from replicator.wire.messages import HeldStep, JobRef, JobSettings, RestoreView, decode_json
from replicator.wire.operator import ClusterStatus
from tests.helpers.reports import node_report, pod_report

KEY = JobRef("default", "routes")
JOB_PATH = f"/v1/jobs/{KEY.namespace}/{KEY.job}"
SETTINGS = JobSettings((), 1, None, 1)
FILES = {"state/a": (10, "00000001")}


def running_job(state, now: float, files=FILES) -> tuple[str, dict[str, int]]:
    """Nodes a and b run the two ranks of a job; each holds its own step 5 of ``files`` (no replicas)."""

    def report(index, incarnation=None, rank=None, held=()):
        pod = pod_report(KEY, 0, index, f"uid{index}", incarnation, rank, nodes=2)
        return node_report("ab"[index], [pod], held, pod_address="127.0.0.1")

    state.apply_report(report(0), now)
    incarnation = state.apply_report(report(1), now).assignments[0].incarnation
    rank_of_pod = state.job(KEY).incarnation.rank_of_pod
    rank_of = {"a": rank_of_pod["uid0"], "b": rank_of_pod["uid1"]}
    for index, node in enumerate("ab"):
        state.apply_report(
            report(index, incarnation, rank_of[node], [HeldStep(KEY.namespace, KEY.job, 5, rank_of[node], files)]), now
        )
    return incarnation, rank_of


def serve(scenario, files=FILES):
    async def run():
        app = service.make_app(CoordinatorConfig("127.0.0.1:0"))
        state = app[routes.STATE_KEY]
        state.expire(time.time() - 100.0)  # started long ago: plans need not wait for reports
        incarnation, rank_of = running_job(state, now=time.time(), files=files)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client, state, incarnation, rank_of)

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("settings", {"incarnation": "x", "rank": -1, "settings": msgspec.to_builtins(SETTINGS)}, "$.rank"),
        ("settings", {"incarnation": "x", "rank": 0}, "settings"),
        ("restore", {"incarnation": "x", "generation": "g", "rank": 0, "bad": [[5, 0]]}, "$.bad[0]"),
        ("restore", {"incarnation": "x", "generation": "g", "rank": 0, "retrying": "yes"}, "$.retrying"),
        ("restore-from", {"step": "5"}, "$.step"),
        ("restore-from", [5], "object"),
    ],
)
def test_a_body_that_does_not_decode_is_a_400_naming_the_field(route, body, field):
    async def scenario(client, state, incarnation, rank_of):
        response = await client.post(f"{JOB_PATH}/{route}", json=body)
        return response.status, await response.json()

    status, reply = serve(scenario)
    assert status == 400 and field in reply["error"], reply


def test_the_routes_answer_with_the_same_json_as_before():
    async def scenario(client, state, incarnation, rank_of):
        settings = await client.post(
            f"{JOB_PATH}/settings",
            json={"incarnation": incarnation, "rank": 0, "settings": msgspec.to_builtins(SETTINGS)},
        )
        unknown = await client.post(
            f"{JOB_PATH}/settings", json={"incarnation": "gone", "rank": 0, "settings": msgspec.to_builtins(SETTINGS)}
        )
        view = await (await client.get(f"{JOB_PATH}/restore", params={"incarnation": incarnation, "rank": "0"})).json()
        staged = await client.post(
            f"{JOB_PATH}/restore",
            json={
                "incarnation": incarnation,
                "generation": view["generation"],
                "rank": 0,
                "source": None,
                "bad": [[5, 0, "a"]],
            },
        )
        incomplete = await client.post(f"{JOB_PATH}/restore-from", json={"step": 4})
        status = await client.get("/v1/status", params={"job": KEY.job})
        return (
            settings.status,
            await settings.json(),
            unknown.status,
            await unknown.json(),
            staged.status,
            await staged.json(),
            incomplete.status,
            await incomplete.json(),
            await status.read(),
            state,
        )

    ok, ok_body, missing, missing_body, staged, staged_body, refused, refused_body, raw, state = serve(scenario)
    assert (ok, ok_body, staged, staged_body) == (200, {"ok": True}, 200, {"ok": True})
    assert missing == 404 and "gone" in missing_body["error"]
    assert refused == 409 and "step 4" in refused_body["error"]
    assert (5, 0, "a") in state.job(KEY).incarnation.excluded  # the staged report's bad copy, decoded
    plain = msgspec.json.decode(raw)
    assert list(plain) == ["nodes", "silent_nodes", "jobs", "heartbeat_seconds"]
    (job,) = plain["jobs"]
    assert list(job) == [
        "namespace",
        "job",
        "incarnation",
        "waiting_pods",
        "ranks",
        "newest_complete_step",
        "restore",
        "held",
        "identical_peers",
        "safe_step",
        "backups",
        "backup_pending",
        "backup_lister",
        "forced_step",
        "timeline",
        "rollbacks",
        "silent_nodes",
        "pending_rollback",
        "last_backup_step",
        "last_backup_age_seconds",
    ]
    node_of = {str(rank): node for rank, node in state.job(KEY).incarnation.node_of_rank.items()}
    assert job["held"] == {"0": {"5": [node_of["0"]]}, "1": {"5": [node_of["1"]]}}
    assert job["ranks"][0] == {"rank": 0, "node": node_of["0"], "pod": job["ranks"][0]["pod"], "silent": False}
    assert job["restore"]["unusable_copies"] == [[5, 0, "a"]]
    assert (job["restore"]["staged_ranks"], job["restore"]["ranks"]) == (0, 2)
    typed = decode_json(raw, ClusterStatus)
    assert typed.jobs[0].held[0][5] == tuple(job["held"]["0"]["5"])
    table = render_status(typed)
    assert f"job {KEY}  incarnation {typed.jobs[0].incarnation}" in table and "5:" in table


def test_a_reply_larger_than_a_write_piece_arrives_whole_with_its_length():
    """Replies above ``WRITE_PIECE_BYTES`` are written in pieces (a TLS connection keeps room for its
    largest write); the client still gets one body with a Content-Length, equal to the state's view."""
    files = {f"state/ocdbt.process_0/d/{index:040x}": (1_000 + index, f"{index:08x}") for index in range(200)}

    async def scenario(client, state, incarnation, rank_of):
        response = await client.get(f"{JOB_PATH}/restore", params={"incarnation": incarnation, "rank": "0"})
        body = await response.read()
        return response.status, response.headers, body, state.restore.view(KEY, incarnation, 0, time.time())

    status, headers, body, view = serve(scenario, files)
    assert len(body) > 2 * routes.WRITE_PIECE_BYTES  # written in three pieces or more
    assert status == 200 and int(headers["Content-Length"]) == len(body) and "Transfer-Encoding" not in headers
    assert headers["Content-Type"].startswith("application/json")
    assert body == msgspec.json.encode(view)
    assert decode_json(body, RestoreView).sources[0].files == files


def test_restore_from_a_complete_step_is_echoed():
    async def scenario(client, state, incarnation, rank_of):
        response = await client.post(f"{JOB_PATH}/restore-from", json={"step": 5})
        return response.status, await response.json(), state.job(KEY).forced_step

    assert serve(scenario) == (200, {"ok": True, "step": 5}, 5)


@pytest.mark.parametrize("text", ["default", "default/", "/run", "a/b/c", ""])
def test_a_job_name_must_be_namespace_slash_job(text):
    with pytest.raises(ValueError, match="NAMESPACE/JOB"):
        JobRef.parse(text)


def test_a_job_name_parses_to_its_ref_and_back():
    assert JobRef.parse("default/routes") == KEY and str(KEY) == "default/routes"


def test_a_report_delayed_past_a_newer_one_is_refused_and_undoes_nothing():
    """Found by the chaos suite's partitions: a report sent while its node was cut off, retransmitted after the cut
    healed, arrived after the node's new pod had joined the incarnation; taken in, its old pod list ended that
    incarnation for good. Reports carry their agent's order (``X-MTC-Report-Order``); an older one is a 409."""

    def report(pod_uid, incarnation=None, rank=None):
        pod = pod_report(KEY, 0, 1, pod_uid, incarnation, rank, nodes=2, suffix=pod_uid)
        return msgspec.to_builtins(node_report("b", [pod], pod_address="127.0.0.1"))

    async def scenario(client, state, incarnation, rank_of):
        session = "ab" * 16
        order = lambda n: {"X-MTC-Report-Order": f"{session}:{n}"}  # noqa: E731
        old = await client.post("/v1/report", json=report("uid1", incarnation, rank_of["b"]), headers=order(1))
        newer = await client.post("/v1/report", json=report("uid1", incarnation, rank_of["b"]), headers=order(3))
        late = await client.post(
            "/v1/report", json=report("uid-gone"), headers=order(2)
        )  # an older pod list, delivered late
        restarted = await client.post(
            "/v1/report",
            json=report("uid1", incarnation, rank_of["b"]),
            headers={"X-MTC-Report-Order": f"{'cd' * 16}:1"},
        )
        replaced = await client.post(
            "/v1/report", json=report("uid-gone"), headers=order(9)
        )  # the agent process before the restart
        malformed = await client.post(
            "/v1/report", json=report("uid1", incarnation, rank_of["b"]), headers={"X-MTC-Report-Order": "x"}
        )
        return (
            old.status,
            newer.status,
            late.status,
            (await late.json())["error"],
            restarted.status,
            replaced.status,
            (await replaced.json())["error"],
            malformed.status,
            state.job(KEY).incarnation,
            incarnation,
        )

    old, newer, late, late_error, restarted, replaced, replaced_error, malformed, current, formed = serve(scenario)
    assert (old, newer, late, restarted, replaced, malformed) == (200, 200, 409, 200, 409, 400)
    assert "report 2 of node b is not newer than report 3" in late_error
    assert "replaced since by" in replaced_error
    assert current is not None and current.incarnation_id == formed  # the incarnation the late report would have ended
