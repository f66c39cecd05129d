"""The coordinator's garbage collector runs by the clock (``process_tuning.GC_THRESHOLDS``): with many small
jobs the net allocation count stays near zero while young objects pile up, so a collection that
waited for the count came late and paused the event loop for up to 0.9 s at 10,000 nodes."""

import asyncio
import gc
import time

from aiohttp.test_utils import TestServer

from replicator.coordinator.api import service
from replicator.coordinator.api.config import CoordinatorConfig


def test_the_ticker_collects_the_young_generations_whatever_the_allocation_count_says():
    async def scenario() -> list[float]:
        collected: list[float] = []

        def seen(phase, info):
            if phase == "stop" and info["generation"] == 1:
                collected.append(time.monotonic())

        thresholds = gc.get_threshold()
        gc.set_threshold(10**9, 10**9, 10**9)  # the count never sets a collection off in this test
        gc.callbacks.append(seen)
        try:
            async with TestServer(service.make_app(CoordinatorConfig("127.0.0.1:0"))):
                await asyncio.sleep(1.4)
        finally:
            gc.callbacks.remove(seen)
            gc.set_threshold(*thresholds)
        return collected

    collected = asyncio.run(scenario())
    assert len(collected) >= 3  # one a tick (0.25 s), young and middle generations together
    assert max(b - a for a, b in zip(collected, collected[1:])) < 1.0
