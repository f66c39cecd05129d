"""The coordinator's recovery snapshot (``<state dir>/recovery.json``) at scale: one job of N ranks on ``xor:8``,
every rank's checksums of the round's step (60 files with Orbax's random data-file names, as
``tests.bench.coordinator_sim`` has them) and its encode order kept.

Prints, per N: the file's size, the time ``collect`` takes on the event loop when the round changed, the time
``write`` takes off it (encode, write, fsync, rename), a check when nothing changed, and the time a restarted
coordinator takes to load and check it. Needs no root: ``python -m tests.bench.recovery_snapshot [N ...]``.
"""

import argparse
import os
import secrets
import tempfile
import time

from replicator.coordinator.api.recovery_snapshot import RecoverySnapshot
from replicator.coordinator.indices.job import pack_files
from replicator.coordinator.indices.parity_orders import ShardSlot
from replicator.coordinator.planning.recovery import JobRecovery, RecoveredBackup, RecoveredChecksums, RecoveredOrder
from replicator.coordinator.state import ClusterState

_STEP, _GROUP = 100, 8


def kept_job(ranks: int) -> JobRecovery:
    """What a coordinator keeps of a job of ``ranks`` ranks in one round of ``xor:8``."""
    checksums, orders = [], []
    for rank in range(ranks):
        files = {
            f"state/ocdbt.process_{rank}/d/{secrets.token_hex(16)}": (1 << 20, f"{secrets.randbits(32):08x}")
            for _ in range(58)
        }
        files |= {"state/_METADATA": (4096, "0badf00d"), "_CHECKPOINT_METADATA": (300, "01234567")}
        checksums.append(RecoveredChecksums(_STEP, rank, pack_files(files)))
    for first in range(0, ranks, _GROUP):
        group = tuple(range(first, min(first + _GROUP, ranks)))
        for position, rank in enumerate(group):
            orders.append(RecoveredOrder(f"node-{rank:05d}", ShardSlot(_STEP, group, 1, position, 0), "ab" * 32))
    return JobRecovery("default", "big", checksums, orders, RecoveredBackup(None, 0.0, "", None, {}, {}, []))


def measure(ranks: int) -> str:
    state = ClusterState()
    state.recover(kept_job(ranks))
    with tempfile.TemporaryDirectory() as state_dir:
        snapshot = RecoverySnapshot(state_dir)
        started = time.perf_counter()
        jobs = snapshot.collect(state, 0.0)
        collected = time.perf_counter()
        assert jobs is not None
        snapshot.write(jobs)
        written = time.perf_counter()
        unchanged = snapshot.collect(state, float("inf"))
        checked = time.perf_counter()
        assert unchanged is None
        size = os.path.getsize(os.path.join(state_dir, "recovery.json"))
        restarted = ClusterState()
        RecoverySnapshot(state_dir).load(restarted)
        loaded = time.perf_counter()
        assert restarted.recovery_records() == jobs
    return (
        f"{ranks:>6} ranks: {size / 1e6:6.1f} MB ({size / ranks:.0f} B a rank); collect {1e3 * (collected - started):5.0f}"
        f" ms on the loop; write {1e3 * (written - collected):5.0f} ms off it; unchanged {1e3 * (checked - written):.2f}"
        f" ms; load and check {1e3 * (loaded - checked):5.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ranks", nargs="*", type=int, default=[1_000, 10_000])
    for ranks in parser.parse_args().ranks:
        print(measure(ranks))


if __name__ == "__main__":
    main()
