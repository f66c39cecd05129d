"""The coordinator's restore route over real HTTP (aiohttp's test server): a request the plan is not
ready for is held and answered once it is, not refused for the agent to retry every second."""

import asyncio
import time

from aiohttp.test_utils import TestClient, TestServer

from replicator.coordinator.api import routes, service
from replicator.coordinator.api.config import CoordinatorConfig
from tests.helpers.coordinator import KEY, running_job


def test_a_restore_request_is_held_until_the_coordinator_can_plan():
    async def scenario():
        app = service.make_app(CoordinatorConfig("127.0.0.1:0"))
        state = app[routes.STATE_KEY]
        incarnation, rank_of = running_job(state, now=time.time())
        state.liveness.started = (
            time.time() - state.liveness.node_timeout_seconds + 1.5
        )  # a fresh coordinator: 1.5 s left to wait
        path = f"/v1/jobs/{KEY.namespace}/{KEY.job}/restore"
        query = {"incarnation": incarnation, "rank": str(rank_of["a"])}
        async with TestClient(TestServer(app)) as client:
            refused = await client.get(path, params=query)  # no wait: answered at once
            assert refused.status == 503 and "started" in (await refused.json())["error"]
            started = time.monotonic()
            held = await client.get(path, params=query | {"wait": "10"})
            assert held.status == 200 and (await held.json())["step"] == 5
            assert 1.0 <= time.monotonic() - started < 5.0  # answered when the wait ended, not at the deadline

    asyncio.run(scenario())
