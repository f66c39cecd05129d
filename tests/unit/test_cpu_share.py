"""The CPU cap of replication and backup: pacing arithmetic on fake clocks, and real busy threads held to their share."""

import threading
import time

import pytest

from replicator.pacing.cpu_share import CpuShare


class Clocks:
    """A wall clock and a CPU clock that the test advances."""

    def __init__(self):
        self.wall = 100.0
        self.cpu = 5.0


def test_work_over_its_share_waits_off_the_excess():
    clocks = Clocks()
    share = CpuShare(0.5, burst_seconds=0.2, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    clocks.wall += 1.0  # an idle second earns only the 0.2 s burst
    clocks.cpu += 0.6  # 0.6 CPU s at half a core take 1.2 s of wall time; 0.2 s of credit
    assert share.delay() == pytest.approx(1.0)
    clocks.wall += 1.0  # the caller slept it off: nothing owed
    assert share.delay() == 0.0
    clocks.wall += 0.1
    clocks.cpu += 0.1  # 0.2 s owed for 0.1 s passed
    assert share.delay() == pytest.approx(0.1)


def test_idle_time_earns_at_most_the_burst():
    clocks = Clocks()
    share = CpuShare(1.0, burst_seconds=0.2, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    clocks.wall += 3600.0
    clocks.cpu += 0.2
    assert share.delay() == 0.0  # within the burst
    clocks.cpu += 0.3
    assert share.delay() == pytest.approx(0.3)


@pytest.mark.parametrize("cores", [0.0, -1.0])
def test_a_share_that_is_not_positive_is_refused(cores):
    with pytest.raises(ValueError, match="must be positive"):
        CpuShare(cores)


def test_busy_threads_that_pause_take_the_wall_time_their_cpu_share_allows():
    share = CpuShare(0.25, burst_seconds=0.2)

    def busy() -> None:
        for _ in range(30):
            deadline = time.thread_time() + 0.005  # 5 ms of CPU per chunk, like a 2 MiB checksum
            while time.thread_time() < deadline:
                pass
            share.pause()

    cpu, wall = time.process_time(), time.monotonic()
    threads = [threading.Thread(target=busy) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    used, elapsed = time.process_time() - cpu, time.monotonic() - wall
    assert used >= 0.3  # the work was done: 2 threads x 30 chunks x 5 ms
    # At a quarter of a CPU, that much CPU needs 4x its seconds of wall time, less the burst; unpaced,
    # two threads on two idle cores would finish in about 0.15 s.
    assert elapsed >= used / 0.25 - 0.2 - 0.05
