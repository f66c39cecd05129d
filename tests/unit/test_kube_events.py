"""client-go's event correlation in ``kube_events.EventCorrelator``, by its clock: the token bucket refills one event
per 5 minutes, a repeat counts only within 10 minutes; and an ``EventRecorder`` whose API server is out of reach
loses the events, one log line each, and keeps sending."""

import asyncio
import contextlib
import logging
import socket

from lightkube import AsyncClient, KubeConfig

from replicator.coordinator.kube.kube_events import (
    BURST,
    REFILL_SECONDS,
    SIMILAR_WINDOW_SECONDS,
    EventCorrelator,
    EventRecorder,
    EventType,
    ObjectRef,
)

POD = ObjectRef("Pod", "v1", "team-a", "trainer-0", "uid-0")


def test_the_bucket_gives_a_burst_then_one_event_per_refill():
    correlator = EventCorrelator()
    sent = [correlator.correlate(POD, EventType.WARNING, "RamdiskFull", f"m{i}", now=0.0) for i in range(BURST + 1)]
    assert sent[-1] is None and all(s is not None for s in sent[:-1])
    assert correlator.correlate(POD, EventType.WARNING, "RamdiskFull", "later", now=REFILL_SECONDS - 1) is None
    assert correlator.correlate(POD, EventType.WARNING, "RamdiskFull", "later", now=REFILL_SECONDS) is not None
    other = ObjectRef("Pod", "v1", "team-a", "trainer-1", "uid-1")  # a bucket per object
    assert correlator.correlate(other, EventType.WARNING, "RamdiskFull", "m", now=0.0) is not None


def test_a_repeat_within_10_minutes_bumps_the_count_and_after_is_a_new_event():
    correlator = EventCorrelator()
    first = correlator.correlate(POD, EventType.NORMAL, "RestoreDone", "done", now=0.0)
    again = correlator.correlate(POD, EventType.NORMAL, "RestoreDone", "done", now=SIMILAR_WINDOW_SECONDS)
    assert first is not None and again is not None
    assert (again.name, again.count, again.first_seen) == (first.name, 2, 0.0)
    later = correlator.correlate(POD, EventType.NORMAL, "RestoreDone", "done", now=2 * SIMILAR_WINDOW_SECONDS + 1)
    assert later is not None and later.count == 1 and later.name != first.name


async def test_a_recorder_without_its_api_server_loses_each_event_in_a_log_line_and_goes_on(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"https://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "gone", "cluster": {"server": url, "insecure-skip-tls-verify": True}}],
            "users": [{"name": "coordinator", "user": {"token": "t"}}],
            "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "coordinator"}}],
            "current-context": "gone",
        }
    )
    client = AsyncClient(config, field_manager="mtc-coordinator")
    recorder = EventRecorder(client)
    task = asyncio.create_task(recorder.run())
    try:
        with caplog.at_level(logging.WARNING, logger="replicator.coordinator.kube.kube_events"):
            recorder.record(POD, EventType.NORMAL, "RestoreStarted", "one")
            recorder.record(POD, EventType.NORMAL, "RestoreDone", "two")
            await asyncio.wait_for(recorder.idle(), 30)
        assert not task.done()
        lost = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
        assert [m.split(" on ")[0] for m in lost] == ["event RestoreStarted", "event RestoreDone"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
