"""The coordinator's state dir: the settings snapshot, written at most every few seconds during a burst of settings,
not once per request; the recovery snapshot (what restores and backups need that no report brings back), written
when it changed and read back whole or not at all."""

import base64
import json
import logging
import os

import pytest

from replicator.coordinator.api import routes, service, settings_snapshot
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.recovery_snapshot import RecoverySnapshot
from replicator.coordinator.indices.job import pack_files
from replicator.coordinator.indices.parity_orders import ShardSlot
from replicator.coordinator.planning.recovery import JobRecovery, RecoveredBackup, RecoveredChecksums, RecoveredOrder
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
        state.restore.settings_from_snapshot(JobRef("default", "big"), rank, settings(rank))
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


KEY = JobRef("default", "ec")
KEPT = JobRecovery(
    KEY.namespace,
    KEY.job,
    [RecoveredChecksums(5, 1, pack_files({"state/r1": (1008, "00000502")}))],
    [RecoveredOrder("n1", ShardSlot(5, (0, 1, 2, 3), 1, 1, 0), "ab" * 32)],
    RecoveredBackup(5, 100.0, "inc-1234abcd", 50.0, {3: 60.0}, {5: 90.0}, [4]),
)


def kept_dir(tmp_path) -> str:
    """A state dir whose recovery file holds ``KEPT``, written as a coordinator writes it."""
    state = ClusterState()
    state.recover(KEPT)
    snapshot = RecoverySnapshot(str(tmp_path))
    snapshot.write(snapshot.collect(state, 0.0))
    return str(tmp_path)


def restarted(state_dir: str) -> ClusterState:
    return service.make_app(CoordinatorConfig("127.0.0.1:0", state_dir=state_dir))[routes.STATE_KEY]


def test_the_recovery_file_gives_a_restarted_coordinator_the_checksums_orders_and_backup_state(tmp_path):
    state = restarted(kept_dir(tmp_path))
    assert state.recovery_records() == [KEPT]
    view = state.job(KEY)
    assert view.owner_files(5, 1) == {"state/r1": (1008, "00000502")}
    assert (view.backup_pending, view.last_backup_time) == (5, 50.0)


def test_the_recovery_file_is_written_again_only_when_what_it_keeps_changed(tmp_path):
    state = ClusterState()
    snapshot = RecoverySnapshot(str(tmp_path))
    assert snapshot.collect(state, 0.0) is None  # nothing kept: nothing to write
    state.recover(KEPT)
    snapshot.write(snapshot.collect(state, 0.0))
    assert snapshot.collect(state, 100.0) is None  # unchanged
    state.recover(JobRecovery(KEY.namespace, KEY.job, [], [], RecoveredBackup(9, 200.0, "inc-2", 50.0, {}, {}, [])))
    assert [job.backup.pending for job in snapshot.collect(state, 100.0)] == [9]
    assert RecoverySnapshot(None).collect(state, 0.0) is None  # no state dir: nothing is kept


def _damage(raw: dict, how: str) -> bytes:
    if how == "truncated":
        return json.dumps(raw).encode()[:-20]
    if how == "other version":
        raw["version"] = 2
    elif how == "checksums not packed":
        raw["jobs"][0]["checksums"][0]["files"] = base64.b64encode(b"not zlib").decode()
    elif how == "negative step":
        raw["jobs"][0]["backup"]["pending"] = -1
    elif how == "not an object":
        raw = [raw]  # type: ignore[assignment]
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "how", ["truncated", "other version", "checksums not packed", "negative step", "not an object"]
)
def test_a_damaged_recovery_file_is_ignored_whole_with_a_warning(tmp_path, caplog, how):
    """Nothing of a file that fails to decode or check is taken in: the agents' reports rebuild what they can."""
    path = os.path.join(kept_dir(tmp_path), "recovery.json")
    with open(path, "rb") as f:
        raw = json.load(f)
    with open(path, "wb") as f:
        f.write(_damage(raw, how))
    with caplog.at_level(logging.WARNING, logger="replicator.coordinator.api.recovery_snapshot"):
        state = restarted(str(tmp_path))
    assert state.recovery_records() == []
    assert KEY not in state.job_keys()
    assert "ignoring unreadable recovery state" in caplog.text
