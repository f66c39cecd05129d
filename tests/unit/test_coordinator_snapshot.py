"""The coordinator's settings snapshot: written at most every few seconds during a burst of settings, not once per request."""

from replicator.coordinator import routes, service, settings_snapshot
from replicator.coordinator.config import CoordinatorConfig
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import JobRef, JobSettings

RANKS = 300


def settings(rank: int) -> JobSettings:
    return JobSettings((rank ^ 1,), 2, 30.0, None)


def test_a_job_start_encodes_one_snapshot_that_a_restarted_coordinator_loads(tmp_path):
    state = ClusterState()
    snapshot = settings_snapshot.SettingsSnapshot(str(tmp_path))
    assert snapshot.encode(state, 0.0) is None  # nothing recorded: nothing to write
    for rank in range(RANKS):  # what post_settings does for each rank of a starting job
        state.restore_settings(JobRef("default", "big"), rank, settings(rank))
        snapshot.due = True
        if rank == RANKS // 2:
            first = snapshot.encode(state, 0.0)  # the ticker, halfway through the burst
    assert first is not None
    assert (
        snapshot.encode(state, 0.5 * settings_snapshot.SNAPSHOT_INTERVAL_SECONDS) is None
    )  # too soon after the last: the rest waits
    data = snapshot.encode(state, settings_snapshot.SNAPSHOT_INTERVAL_SECONDS)
    assert (
        data is not None and snapshot.encode(state, 10 * settings_snapshot.SNAPSHOT_INTERVAL_SECONDS) is None
    )  # then nothing is due
    snapshot.write(data)
    restarted = service.make_app(CoordinatorConfig("127.0.0.1:0", state_dir=str(tmp_path)))
    loaded = restarted[routes.STATE_KEY].job(JobRef("default", "big")).settings
    assert loaded == {rank: settings(rank) for rank in range(RANKS)}


def test_without_a_state_dir_nothing_is_written():
    snapshot = settings_snapshot.SettingsSnapshot(None)
    snapshot.due = True
    assert snapshot.encode(ClusterState(), 0.0) is None
