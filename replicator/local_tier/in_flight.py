"""Transfers in flight as a pair of per-job gauges: the bytes planned and the bytes moved so far.

Both sum over the job's transfers running now on this node and are 0 when none runs, so
``done / planned`` is the progress of what is in flight. Bytes are counted per range or file, never
per byte: the data path pays one gauge update per 32-64 MiB.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator

from prometheus_client import Gauge

from replicator.wire.metric_labels import JOB_LABELS


class InFlight:
    """The gauges ``<prefix>_in_flight_planned_bytes`` and ``<prefix>_in_flight_<verb>_bytes``,
    labelled by ``JOB_LABELS``.

    Args:
      prefix: the metrics' prefix, e.g. ``mtc_restore``.
      verb: what the transfer does to bytes, e.g. ``fetched``.
      what: the transfers, for the help text, e.g. ``restores``.
    """

    def __init__(self, prefix: str, verb: str, what: str):
        self.planned = Gauge(
            f"{prefix}_in_flight_planned_bytes", f"Bytes the job's {what} running on this node move in all", JOB_LABELS
        )
        self.done = Gauge(
            f"{prefix}_in_flight_{verb}_bytes", f"Bytes the job's {what} running on this node {verb} so far", JOB_LABELS
        )

    @contextlib.contextmanager
    def transfer(self, namespace: str, job: str, total: int) -> Iterator[Callable[[int], None]]:
        """Counts one transfer of ``total`` bytes of the job while the block runs, whatever its
        outcome; yields the callback to call with each range's or file's byte count as it lands
        (thread-safe)."""
        planned, done = self.planned.labels(namespace, job), self.done.labels(namespace, job)
        lock, moved = threading.Lock(), [0]

        def add(count: int) -> None:
            with lock:
                moved[0] += count
            done.inc(count)

        planned.inc(total)
        try:
            yield add
        finally:
            planned.dec(total)
            with lock:
                done.dec(moved[0])

    def seed(self, namespace: str, job: str) -> None:
        """The job's series exist, at 0 if new."""
        self.planned.labels(namespace, job)
        self.done.labels(namespace, job)

    def forget(self, namespace: str, job: str) -> None:
        """The job's series are removed (its ramdisk left the node)."""
        for gauge in (self.planned, self.done):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, job)
