"""The coordinator's typed routes over real HTTP (aiohttp's test server): bodies decode at the edge
into ``messages`` structs, a bad one is a 400 whose error names the field, and the JSON field names
stay what ``mtc`` clients of earlier releases send and read."""

import asyncio
import time

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from replicator.coordinator import service
from replicator.coordinator.status import render_status
from replicator.wire.messages import HeldStep, JobRef, JobSettings, NodeReport, PodReport, decode_json
from replicator.wire.operator import ClusterStatus

KEY = JobRef("default", "routes")
JOB_PATH = f"/v1/jobs/{KEY.namespace}/{KEY.job}"
SETTINGS = JobSettings((), 1, None, 1)
FILES = {"state/a": (10, "00000001")}


def running_job(state, now: float) -> tuple[str, dict[str, int]]:
    """Nodes a and b run the two ranks of a job; each holds its own step 5 (no replicas)."""

    def report(index, incarnation=None, rank=None, held=()):
        pod = PodReport(KEY.namespace, KEY.job, f"routes-0-{index}-x", f"uid{index}", 0, index, 2, 1, 8476, "routes", 0.0, incarnation, rank)
        return NodeReport("ab"[index], f"http://{'ab'[index]}", "127.0.0.1", {}, (pod,), tuple(held))

    state.apply_report(report(0), now)
    incarnation = state.apply_report(report(1), now).assignments[0].incarnation
    rank_of_pod = state.job(KEY).incarnation.rank_of_pod
    rank_of = {"a": rank_of_pod["uid0"], "b": rank_of_pod["uid1"]}
    for index, node in enumerate("ab"):
        state.apply_report(report(index, incarnation, rank_of[node], [HeldStep(KEY.namespace, KEY.job, 5, rank_of[node], FILES)]), now)
    return incarnation, rank_of


def serve(scenario):
    async def run():
        app = service.make_app(service.CoordinatorConfig("127.0.0.1:0"))
        state = app[service._STATE_KEY]
        state.expire(time.time() - 100.0)  # started long ago: plans need not wait for reports
        incarnation, rank_of = running_job(state, now=time.time())
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
        settings = await client.post(f"{JOB_PATH}/settings", json={"incarnation": incarnation, "rank": 0, "settings": msgspec.to_builtins(SETTINGS)})
        unknown = await client.post(f"{JOB_PATH}/settings", json={"incarnation": "gone", "rank": 0, "settings": msgspec.to_builtins(SETTINGS)})
        view = await (await client.get(f"{JOB_PATH}/restore", params={"incarnation": incarnation, "rank": "0"})).json()
        staged = await client.post(f"{JOB_PATH}/restore", json={"incarnation": incarnation, "generation": view["generation"], "rank": 0,
                                                                "source": None, "bad": [[5, 0, "a"]]})  # fmt: skip
        incomplete = await client.post(f"{JOB_PATH}/restore-from", json={"step": 4})
        status = await client.get("/v1/status", params={"job": KEY.job})
        return (settings.status, await settings.json(), unknown.status, await unknown.json(), staged.status, await staged.json(),
                incomplete.status, await incomplete.json(), await status.read(), state)  # fmt: skip

    ok, ok_body, missing, missing_body, staged, staged_body, refused, refused_body, raw, state = serve(scenario)
    assert (ok, ok_body, staged, staged_body) == (200, {"ok": True}, 200, {"ok": True})
    assert missing == 404 and "gone" in missing_body["error"]
    assert refused == 409 and "step 4" in refused_body["error"]
    assert (5, 0, "a") in state.job(KEY).incarnation.excluded  # the staged report's bad copy, decoded
    plain = msgspec.json.decode(raw)
    assert list(plain) == ["nodes", "silent_nodes", "jobs", "heartbeat_seconds"]
    (job,) = plain["jobs"]
    assert list(job) == ["namespace", "job", "incarnation", "waiting_pods", "ranks", "newest_complete_step", "restore", "held",
                         "identical_peers", "safe_step", "backups", "backup_pending", "backup_lister", "forced_step", "timeline",
                         "rollbacks"]  # fmt: skip
    node_of = {str(rank): node for rank, node in state.job(KEY).incarnation.node_of_rank.items()}
    assert job["held"] == {"0": {"5": [node_of["0"]]}, "1": {"5": [node_of["1"]]}}
    assert job["ranks"][0] == {"rank": 0, "node": node_of["0"], "pod": job["ranks"][0]["pod"]}
    assert job["restore"]["unusable_copies"] == [[5, 0, "a"]]
    typed = decode_json(raw, ClusterStatus)
    assert typed.jobs[0].held[0][5] == tuple(job["held"]["0"]["5"])
    table = render_status(typed)
    assert f"job {KEY}  incarnation {typed.jobs[0].incarnation}" in table and "5:" in table


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
