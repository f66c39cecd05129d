"""Room on a job's ramdisk: unsafe copies given up for a fetched copy or the next save, by the retain orders."""

import logging
import threading
from collections.abc import Iterable

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier import space
from replicator.local_tier.job_keys import BusySteps, job_of
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import LogOnce
from replicator.node.garbage_collection import pressure_order
from replicator.node.notices import NodeNotices
from replicator.wire.messages import JobRef, RetainOrder

log = logging.getLogger(__name__)


class RoomKeeper:
    """Keeps room on the node's job ramdisks, giving up unsafe copies by the coordinator's latest retain orders.

    Args:
      busy_steps: steps being read by a push, an upload or a restore: never given up.
      log_once: the agent's throttled error log (the job hears of a ramdisk too small).
      replicas: replicas of each step this node may host (the sizing rule's count).
      notices: the node's notices: a full ramdisk is a ``RamdiskNearlyFull`` event on the pod.
    """

    def __init__(self, busy_steps: BusySteps, log_once: LogOnce, replicas: int, notices: NodeNotices | None = None):
        self._busy_steps = busy_steps
        self._log_once = log_once
        self._replicas = replicas
        self._notices = notices or NodeNotices()
        self._orders: dict[JobRef, RetainOrder] = {}  # the latest reply's: what ``space.make_room`` may give up
        self._orders_sent = 0.0  # when the report that brought them was sent (wall clock)
        self._making_room = threading.Lock()

    def learn(self, orders: Iterable[RetainOrder], sent: float) -> None:
        """Keeps a reply's retain orders; ``sent``: when its report was sent (wall clock, seconds)."""
        self._orders = {JobRef(order.namespace, order.job): order for order in orders}
        self._orders_sent = sent

    def make_room(self, disk: Ramdisk, need: int, keep: int | None = None) -> None:
        """Gives up unsafe copies on ``disk`` until ``need`` bytes are free or none is left
        (``space.make_room``, with the job's latest retain order), but of step ``keep``; logs each one."""
        key = job_of(disk)
        ordered = self._orders.get(key)
        order = pressure_order(disk, ordered)
        busy = self._busy_steps.of(key) | ({keep} if keep is not None else set())
        with self._making_room:  # the watch pass, the peer service and a restore may all ask at once
            given_up = space.make_room(disk, order, busy, need, self._orders_sent if ordered is not None else None)
        for copy in given_up:
            space.GIVEN_UP.inc()
            log.warning(
                "%s/%s: gave up %s step %d (%d bytes, not safe) to free %d bytes; steps up to %d are kept (safe, or restored)",
                key.namespace,
                key.job,
                copy.what,
                copy.step,
                copy.bytes,
                need,
                order.keep_from,  # type: ignore[union-attr]  # nothing is given up without an order
            )

    def keep_room(self, key: JobRef, disk: Ramdisk, meta: JobMeta, progress: PodProgress) -> None:
        """Keeps the job's next save's bytes free (``space``): gives up unsafe copies when they are not,
        and tells the job, with the numbers, when its ramdisk is below the sizing rule for the saves it
        makes, or full anyway (a save that does not fit)."""
        need = space.next_save_bytes(meta)
        if need and progress.settings is not None:
            shards = space.shards_needed(progress.settings.data_parallelism, self._replicas)
            if disk.size_bytes < shards * need:
                self._log_once(
                    f"sizing-{key}-{progress.incarnation}",
                    f"ramdisk below the sizing rule: it holds {disk.size_bytes} bytes, a save of"
                    f" this job takes about {need}, and with data parallelism {progress.settings.data_parallelism} it needs"
                    f" {shards} of them ({shards * need} bytes); saves may fail or steps become safe later"
                    f" (docs/operations.md#sizing)",
                    meta,
                )
        if space.free_bytes(disk.path) >= need and not space.is_full(disk.path):
            space.keep_reserve(meta)
            return
        self.make_room(disk, need)
        if space.is_full(disk.path):
            order = self._orders.get(key)
            safe = f"the newest safe step is {order.keep_from}" if order else "no step is safe yet"
            expected = f"a save of this job takes about {need} bytes" if need else "no save has completed on it yet"
            message = (
                f"ramdisk too small: {space.describe_use(disk)}; {expected}, and nothing unsafe is left to give up ({safe});"
                f" make the volume's size larger (docs/operations.md#sizing)"
            )
            space.release_reserve(meta)  # the report needs pages; each pod of the job hears it once
            self._notices.add("RamdiskNearlyFull", message, key.namespace, progress.pod_uid)
            try:
                self._log_once(f"full-{key}-{progress.pod_uid}", message, meta)
            except OSError as err:  # no page left even so: the log line has it
                log.warning(
                    "%s/%s: could not write replicator.errors on the full ramdisk: %s", key.namespace, key.job, err
                )
