"""``<state_dir>/recovery.json``: what restores and backups need that no report brings back (``recovery``).

Written by the ticker (``service``) within a tick of a change: a lost rank's checksums and the encode orders change
when a replication round's step is ordered, the backup state when a backup is chosen or completes. A write replaces
the file whole (``atomic_file``: tmp, fsync, rename), so a coordinator killed mid-write leaves the previous one.

The file is versioned (``FORMAT_VERSION``), read with a size cap (``MAX_BYTES``) and decoded into typed, bounded
structs; every checksum kept is unpacked once. A file that fails any of it (damaged, of another version, too big)
is ignored with a warning and the coordinator rebuilds from the agents' reports alone, as without a state dir: it
never half-loads a file. What it holds stays bounded by what the coordinator holds: the steps some encode order is
of (the round's, at most a few), and the backup state of each job (``backups._SAFE_AT_KEPT`` safe steps at most).
"""

import logging
import os
import time

import msgspec

from csi_driver import atomic_file
from replicator.coordinator.planning import recovery
from replicator.coordinator.state import ClusterState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# A file larger than this is not read (a 10,000-rank job's round of 60-file checksums: 25 MB).
MAX_BYTES = 1 << 30
# At most about this share of the time goes to writes: a write that took d seconds is followed by the next one no
# sooner than d / share after it was collected (a small state is written within a tick of a change).
_WRITE_SHARE = 0.1


class RecoveryFile(msgspec.Struct, frozen=True, gc=False):
    """The file's content: its format version, when it was written (unix seconds), and each job's part."""

    version: int
    written_at: float
    jobs: list[recovery.JobRecovery]


class _Version(msgspec.Struct):
    """Any version's file: its format version alone (the rest is skipped)."""

    version: int


class RecoverySnapshot:
    """Keeps ``<state_dir>/recovery.json`` (``state_dir`` None: nothing is kept)."""

    def __init__(self, state_dir: str | None):
        self.path = os.path.join(state_dir, "recovery.json") if state_dir else None
        self._stamp: tuple[object, ...] | None = None
        self._written: list[recovery.JobRecovery] | None = []  # nothing kept: nothing to write
        self._collected_at = float("-inf")
        self._cost = 0.0  # seconds the last write took

    def collect(self, cluster: ClusterState, now: float) -> list[recovery.JobRecovery] | None:
        """What to write (hand it to ``write``) if it changed since the last write and the pacing allows at ``now``
        (monotonic seconds), else None. Cheap when nothing changed: it compares stamps, not the state."""
        if self.path is None or now < self._collected_at + self._cost / _WRITE_SHARE:
            return None
        stamp = cluster.recovery_stamp()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        jobs = cluster.recovery_records()
        if jobs == self._written:
            return None
        self._written, self._collected_at = jobs, now
        return jobs

    def write(self, jobs: list[recovery.JobRecovery]) -> None:
        """Encodes and writes ``jobs`` crash-safe; runs off the event loop (the structs are not changed after
        ``collect``). Raises OSError."""
        assert self.path is not None  # collect gives jobs to write only with a path
        started = time.monotonic()
        try:
            atomic_file.write_file_atomic(
                self.path, msgspec.json.encode(RecoveryFile(FORMAT_VERSION, time.time(), jobs))
            )
        except OSError:
            self._stamp = self._written = None  # collected again next tick
            raise
        self._cost = time.monotonic() - started

    def load(self, cluster: ClusterState) -> None:
        """Takes in the last file written, if any. One that cannot be read, decoded or checked is ignored whole
        (logged): the agents' reports rebuild what they can."""
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES} bytes")
            if (version := msgspec.json.decode(data, type=_Version).version) != FORMAT_VERSION:
                raise ValueError(f"format version {version!r}, not {FORMAT_VERSION}")
            found = msgspec.json.decode(data, type=RecoveryFile)
            for job in found.jobs:
                recovery.check(job)
        except (OSError, ValueError) as err:  # msgspec's DecodeError and ValidationError are ValueErrors
            log.warning(
                "ignoring unreadable recovery state %s (%s): a rank lost before this restart is restored from a replica "
                "or the backup tier, not decoded, and a backup in progress is chosen anew",
                self.path,
                err,
            )
            return
        for job in found.jobs:
            cluster.recover(job)
        log.info(
            "recovered %d job(s) from %s, written %.0f s ago",
            len(found.jobs),
            self.path,
            time.time() - found.written_at,
        )
