"""Wake-ups of the coordinator's long polls: a report waiting for its pod's assignment, a rank
waiting for its restore view to change."""

import asyncio
import contextlib
from collections.abc import Iterable

from replicator.coordinator.state import ClusterState
from replicator.wire.messages import JobRef


class JobChanges:
    """Wakes long polls when a job's assignments or restore views may have changed: one event per
    job, replaced each time it fires, so a waiter sees every change after it started waiting."""

    def __init__(self, state: ClusterState):
        self._state = state
        self._events: dict[JobRef, asyncio.Event] = {}

    def event(self, key: JobRef) -> asyncio.Event:
        """The event the next change of ``key`` fires."""
        return self._events.setdefault(key, asyncio.Event())

    def publish(self) -> None:
        """Fires the events of every job the state marked changed."""
        self.wake(self._state.drain_changed())

    def wake(self, keys: Iterable[JobRef]) -> None:
        """Fires the events of ``keys``."""
        for key in keys:
            if (event := self._events.pop(key, None)) is not None:
                event.set()

    async def wait(self, keys: Iterable[JobRef], timeout: float) -> None:
        """Waits until one of ``keys`` changes or ``timeout`` seconds pass."""
        keys = list(keys)
        if len(keys) == 1:
            # The common case (a node's one waiting pod): no task per waiter. A new incarnation of a
            # 10,000-node job starts and wakes 10,000 of these at once.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.event(keys[0]).wait()
            return
        waiters = [asyncio.ensure_future(self.event(key).wait()) for key in keys]
        if not waiters:
            return
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
