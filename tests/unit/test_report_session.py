"""The agent's change-driven reporting as a pure function of what it holds, replies and time."""

from replicator.node.report_session import HeldCopy, OwnStep, ReportSession
from replicator.wire.messages import BackedUp, JobRef, ReportReply

JOB = JobRef("default", "j")
FILES = {"_CHECKPOINT_METADATA": (10, "00000001"), "state/_METADATA": (20, "00000002")}
OWN = [OwnStep(HeldCopy(JOB, 5, 0), FILES)]
REPLICA = HeldCopy(JOB, 5, 1)


def test_checksums_go_once_then_heartbeats_are_small_and_paced_by_the_coordinator():
    session = ReportSession("n0", "http://n0", None, {}, 1, True)
    first = session.build((), OWN, [REPLICA], (), waiting=False)
    assert first.held[0].files == FILES and first.held[0].signature and first.held[1].files is None
    assert session.due(first, 0.0)
    session.acknowledge(first, ReportReply((), heartbeat_seconds=10.0, list_backups=(JOB,)), 0.0)
    again = session.build((), OWN, [REPLICA], (), waiting=False)
    assert again.held[0].files is None and again.held[0].signature == first.held[0].signature
    assert not session.due(again, 7.9)  # nothing changed: wait for the jittered heartbeat (8-10 s)
    assert session.due(again, 10.0)
    assert [(h.namespace, h.job, h.step, h.rank, h.replica) for h in again.held] == [
        ("default", "j", 5, 0, False),
        ("default", "j", 5, 1, True),
    ]
    assert session.list_backups == {JOB}


def test_a_change_or_a_poke_is_reported_at_once():
    session = ReportSession("n0", "http://n0", None, {}, 1, True)
    report = session.build((), OWN, (), (), waiting=False)
    session.acknowledge(report, ReportReply((), heartbeat_seconds=10.0), 0.0)
    listed = session.build((), OWN, (), [BackedUp("default", "j", ((5, 0),), 1.0)], waiting=False)
    assert session.due(listed, 0.1)
    session.acknowledge(listed, ReportReply((), heartbeat_seconds=10.0), 0.1)
    assert not session.due(session.build((), OWN, (), [BackedUp("default", "j", ((5, 0),), 1.0)], waiting=False), 0.2)
    session.poked = True
    assert session.due(listed, 0.2)


def test_a_coordinator_that_lacks_checksums_gets_them_in_the_next_report():
    session = ReportSession("n0", "http://n0", None, {}, 1, False)
    session.acknowledge(session.build((), OWN, (), (), waiting=False), ReportReply((), heartbeat_seconds=1.0), 0.0)
    bare = session.build((), OWN, (), (), waiting=False)
    assert bare.held[0].files is None
    session.acknowledge(bare, ReportReply((), want_files=True), 0.5)  # e.g. a restarted coordinator
    assert session.poked and session.build((), OWN, (), (), waiting=False).held[0].files == FILES


def test_failed_reports_back_off_exponentially_with_jitter_and_a_reply_resets_it():
    sessions = [ReportSession(f"n{i}", f"http://n{i}", None, {}, 1, True) for i in range(200)]
    report = sessions[0].build((), OWN, (), (), waiting=False)
    retries = []
    for session in sessions:  # every agent of a cluster fails at the same moments
        at, now = [], 0.0
        for _ in range(8):
            session.failed(now)
            now = next(t / 100 for t in range(int(now * 100), 10_000) if session.due(report, t / 100))
            at.append(now)
        retries.append(at)
    gaps = [
        [round(b - a, 2) for a, b in zip([0.0, *at], at)] for at in retries
    ]  # on the 10 ms grid: 27.3 - 17.3 is 10.000000000000004
    first, capped = [g[0] for g in gaps], [g[-1] for g in gaps]
    assert 0.5 <= min(first) and max(first) <= 1.0  # the first retry: U(0.5, 1) x 1 s
    assert 5.0 <= min(capped) and max(capped) <= 10.0  # after 8 failures: U(0.5, 1) x the 10 s cap
    assert max(capped) - min(capped) > 3.0  # spread out, not in lockstep
    assert all(g[3] > g[0] for g in gaps)  # growing
    session = sessions[0]
    assert not session.due(report, retries[0][-1] - 0.01)  # even a changed report waits out the backoff
    session.acknowledge(report, ReportReply((), heartbeat_seconds=1.0), 100.0)
    session.failed(100.0)
    assert session.due(report, 101.0)  # a reply reset the backoff to its first step
