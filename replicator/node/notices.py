"""What the node agent tells its operator as Kubernetes Warning events, through the coordinator.

The agents hold no API credentials, so a notice (``wire.messages.Notice``) rides on the node's next report (a
poke sends it at once) and the coordinator records the event (``coordinator.kube.node_notices``). Fed by:

- the CSI publish path (``on_refused``, ``csi_driver`` hooks): ``VolumeRefused``, with the refusal's message, on
  the pod whose volume was refused;
- ``RoomKeeper.keep_room``: ``RamdiskNearlyFull``, on the pod whose next save does not fit;
- ``StoreCheck``: ``BackupStoreUnusable``, on the Node, when the store probe at the agent's start fails.

A notice stays pending until a report carrying it is acknowledged (a report that failed carries it again). The
same notice (reason, pod, message) is taken again only after ``REPEAT_SECONDS``, so a condition seen on every
pass of the loop does not make every report carry it; at most ``MAX_NOTICES`` wait, the newest dropped past that.
Thread-safe: the gRPC servicer's threads and the loop's worker threads add.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from csi_driver.volume_request import POD_NAMESPACE_KEY, POD_UID_KEY
from replicator.wire.messages import MAX_NOTICE_CHARS, MAX_NOTICES, Notice

log = logging.getLogger(__name__)

REPEAT_SECONDS = 300.0  # one notice per condition per 5 minutes: the coordinator's correlator counts repeats anyway
_MAX_REMEMBERED = 1_024  # notices remembered for REPEAT_SECONDS, at most


class NodeNotices:
    """The node's pending notices.

    Args:
      clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[Notice] = []
        self._taken: dict[Notice, float] = {}  # notice -> when it was last taken
        self.poke: Callable[[], None] = lambda: None  # set by the report session: a notice asks for a report

    def add(self, reason: str, message: str, namespace: str | None = None, pod_uid: str | None = None) -> None:
        """Takes a notice (``reason`` one of ``NOTICE_REASONS``; ``namespace`` and ``pod_uid`` of the pod it is
        about, or None for the node); ``message`` is cut to ``MAX_NOTICE_CHARS``."""
        if len(message) > MAX_NOTICE_CHARS:
            message = message[: MAX_NOTICE_CHARS - 3] + "..."
        notice = Notice(reason, message, namespace or None, pod_uid or None)
        now = self._clock()
        with self._lock:
            if now - self._taken.get(notice, -REPEAT_SECONDS - 1.0) <= REPEAT_SECONDS:
                return
            if len(self._pending) >= MAX_NOTICES:
                log.warning("%d notices wait for the coordinator: %s dropped (%s)", MAX_NOTICES, reason, message)
                return
            self._taken = {n: t for n, t in self._taken.items() if now - t <= REPEAT_SECONDS}
            if len(self._taken) < _MAX_REMEMBERED:
                self._taken[notice] = now
            self._pending.append(notice)
        self.poke()

    def refused(self, volume_context: Mapping[str, str], message: str) -> None:
        """A CSI publish refused (``NodeServicer``'s ``on_refused``): ``VolumeRefused`` on the pod the kubelet
        named in the volume context."""
        self.add(
            "VolumeRefused",
            f"volume refused: {message}",
            volume_context.get(POD_NAMESPACE_KEY),
            volume_context.get(POD_UID_KEY),
        )

    def pending(self) -> tuple[Notice, ...]:
        """The notices not yet acknowledged, oldest first."""
        with self._lock:
            return tuple(self._pending)

    def sent(self, notices: Iterable[Notice]) -> None:
        """Drops ``notices``: a report carrying them was acknowledged."""
        done = set(notices)
        if done:
            with self._lock:
                self._pending = [n for n in self._pending if n not in done]
