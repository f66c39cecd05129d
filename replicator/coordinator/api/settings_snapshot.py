"""The job settings a coordinator keeps on disk (``--state-dir``) to warm a restart."""

import json
import logging
import os

import msgspec

from csi_driver import atomic_file
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import JobRef, JobSettings, decode

log = logging.getLogger(__name__)

# The settings snapshot is written at most this often while settings keep arriving: a job of 10,000
# ranks records its settings over many ticks, and every write encodes them all (3.4 MB). Settings
# recorded since the last write are not lost with a crash: every report carries its pods' settings.
SNAPSHOT_INTERVAL_SECONDS = 2.0


class SettingsSnapshot:
    """The job settings kept in ``<state_dir>/settings.json`` to warm a restart.

    Written by the ticker when settings changed (``due``), not by each settings request: one write
    costs the size of every job's settings and two fsyncs, so a write per request made a job start of
    N ranks cost N² in the event loop (minutes at 10,000 ranks).
    """

    def __init__(self, state_dir: str | None):
        self.path = os.path.join(state_dir, "settings.json") if state_dir else None
        self.due = False
        self._encoded_at = float("-inf")

    def encode(self, cluster: ClusterState, now: float) -> bytes | None:
        """The snapshot to write if one is due and none was encoded in the last
        ``SNAPSHOT_INTERVAL_SECONDS`` before ``now`` (monotonic seconds); clears ``due``. Else None."""
        if self.path is None or not self.due or now - self._encoded_at < SNAPSHOT_INTERVAL_SECONDS:
            return None
        self.due, self._encoded_at = False, now
        return msgspec.json.encode(
            [
                {
                    "namespace": key.namespace,
                    "job": key.job,
                    "settings": {str(r): s for r, s in cluster.job(key).settings.items()},
                }
                for key in cluster.job_keys()
            ]
        )

    def write(self, data: bytes) -> None:
        """Writes ``data`` crash-safe (tmp, fsync, rename). Raises OSError."""
        assert self.path is not None  # encode gives data to write only with a path
        atomic_file.write_file_atomic(self.path, data)

    def load(self, cluster: ClusterState) -> None:
        """Records the settings of the last snapshot written, if any, in ``cluster``. An unreadable
        snapshot is ignored (logged): every report carries its pods' settings again."""
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                for item in json.load(f):
                    key = JobRef(item["namespace"], item["job"])
                    for rank, settings in item["settings"].items():
                        cluster.restore.settings_from_snapshot(key, int(rank), decode(settings, JobSettings))
        except (OSError, ValueError, KeyError) as err:
            log.warning("ignoring unreadable state snapshot %s: %s", self.path, err)
