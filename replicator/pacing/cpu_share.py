"""A cap on the node agent's CPU while it replicates and backs up, so the training job keeps the node.

Replication (checksumming a new step, pushing it, receiving and verifying a peer's) and backup
(content identities) call ``pause`` or ``wait`` between chunks of work. The share is measured on the
whole agent process (``time.process_time``: every thread, user + system), the way a cgroup's CPU
quota would see it, so work that is not paced (serving, reports) counts against it too. Restores do
not pace: the job is not training then, and they should use every core.
"""

import asyncio
import threading
import time
from collections.abc import Callable


class CpuShare:
    """Keeps the process at most ``cores`` CPUs, on average, while paced work runs.

    Paced work runs on a virtual clock that advances by CPU seconds / ``cores``; a caller whose
    virtual clock is ahead of the wall clock sleeps off the difference. Idle time earns credit for
    at most ``burst_seconds`` of wall time, so a save after a quiet minute is paced from its start.
    Thread-safe.

    Args:
      cores: CPUs the agent may use, e.g. 0.5 for half a core; > 0.
      burst_seconds: the largest idle credit, seconds.
      clock, cpu_clock: wall and process CPU clocks, seconds (tests pass fakes).

    Raises:
      ValueError: ``cores`` or ``burst_seconds`` is not positive.
    """

    def __init__(
        self,
        cores: float,
        burst_seconds: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ):
        if cores <= 0 or burst_seconds <= 0:
            raise ValueError(f"cores ({cores}) and burst_seconds ({burst_seconds}) must be positive")
        self.cores = cores
        self._burst = burst_seconds
        self._clock, self._cpu_clock = clock, cpu_clock
        self._lock = threading.Lock()
        self._cpu = cpu_clock()
        self._virtual = clock() - burst_seconds

    def delay(self) -> float:
        """Seconds the caller should sleep now to keep the process within its share."""
        with self._lock:
            now, cpu = self._clock(), self._cpu_clock()
            # The CPU since the last call counts as if used just now: idle credit stays within the burst.
            self._virtual = max(self._virtual, now - self._burst) + (cpu - self._cpu) / self.cores
            self._cpu = cpu
            return max(0.0, self._virtual - now)

    def pause(self) -> None:
        """Sleeps off the excess, on a worker thread."""
        time.sleep(self.delay())

    async def wait(self) -> None:
        """Sleeps off the excess, on the event loop."""
        await asyncio.sleep(self.delay())
