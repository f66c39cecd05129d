"""The node side's job key, ``JobRef``, at the edge with the CSI driver, and the steps being read.

The CSI driver (which knows nothing of ``replicator``) keys its ramdisks by a (namespace, job)
pair; the node side turns them into ``JobRef`` here, once, and keys everything by it.
"""

import collections
import contextlib
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
    """The steps a push or an upload is reading, per job: garbage collection keeps them.

    Shared by the node's pushes, its backup uploads and its garbage collection, all on one event
    loop (garbage collection reads it from a thread the loop awaits).
    """

    def __init__(self) -> None:
        # (job, step) -> how many readers: a push and an upload may read one step at once, and the
        # first to finish must not free it while the other still reads.
        self._steps: collections.Counter[tuple[JobRef, int]] = collections.Counter()

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
