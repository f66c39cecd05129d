"""The node side's job key, ``JobRef``, at the edge with the CSI driver, and the steps being read.

The CSI driver (which knows nothing of ``replicator``) keys its ramdisks by a (namespace, job)
pair; the node side turns them into ``JobRef`` here, once, and keys everything by it.
"""

import collections
import contextlib
import time
from collections.abc import Iterator, Mapping

from csi_driver.ramdisk import Ramdisk
from replicator.wire.messages import JobRef


def job_of(disk: Ramdisk) -> JobRef:
    """The job whose ramdisk ``disk`` is."""
    return JobRef(disk.namespace, disk.job)


def by_job(ramdisks: Mapping[tuple[str, str], Ramdisk]) -> dict[JobRef, Ramdisk]:
    """``RamdiskManager.ramdisks()`` keyed by ``JobRef``."""
    return {JobRef(disk.namespace, disk.job): disk for disk in ramdisks.values()}


class BusySteps:
    """The steps a push or an upload is reading, per job, and the steps a restore was told to stage: garbage
    collection keeps them.

    Shared by the node's pushes, its backup uploads and its garbage collection, all on one event
    loop (garbage collection reads it from a thread the loop awaits).
    """

    def __init__(self) -> None:
        # (job, step) -> how many readers: a push and an upload may read one step at once, and the
        # first to finish must not free it while the other still reads.
        self._steps: collections.Counter[tuple[JobRef, int]] = collections.Counter()
        # job -> {step: when a restore view named it, monotonic seconds}
        self._restoring: dict[JobRef, dict[int, float]] = {}

    @contextlib.contextmanager
    def reading(self, job: JobRef, step: int) -> Iterator[None]:
        """Marks ``job``'s ``step`` busy for the block (blocks may nest and overlap)."""
        busy = (job, step)
        self._steps[busy] += 1
        try:
            yield
        finally:
            self._steps[busy] -= 1
            if not self._steps[busy]:
                del self._steps[busy]

    def of(self, job: JobRef) -> set[int]:
        """The steps of ``job`` being read now."""
        # A copy first (one step under the GIL): garbage collection asks from a thread while the loop adds.
        return {step for busy_job, step in tuple(self._steps) if busy_job == job}

    def restoring(self, job: JobRef, step: int) -> None:
        """Records that a restore of ``job`` was just told to stage ``step`` (the coordinator's restore view)."""
        self._restoring.setdefault(job, {})[step] = time.monotonic()

    def restored_after(self, job: JobRef, asked_at: float) -> set[int]:
        """The steps of ``job`` a restore was told to stage at or after ``asked_at`` (monotonic seconds): a retain
        order answering a report sent before then predates the plan (a restore replanned to an older step), so it
        must not delete them. Forgets the older ones: orders are carried out in the order they were asked for."""
        seen = self._restoring.get(job, {})
        for step in [s for s, at in seen.items() if at < asked_at]:
            del seen[step]
        return set(seen)
