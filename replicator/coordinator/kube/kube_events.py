"""Kubernetes Events from the coordinator (``--kube``), correlated as client-go's ``EventRecorder`` does.

client-go's recorder (``tools/record``, ``events_cache.go``) passes every event through three steps, and so does
``EventCorrelator`` here, with the same constants:

- a spam filter: a token bucket per involved object (burst 25, one token back every 5 minutes); an event without a
  token is dropped;
- an aggregator: more than 10 events of one object, type and reason with different messages within 10 minutes are
  folded into one event, its message ``(combined from similar events): <the newest message>``;
- a logger: an event equal to one sent within 10 minutes (object, type, reason, message) bumps that event's
  ``count`` and ``lastTimestamp`` with a merge patch instead of creating another.

Events are core/v1 ``Event`` objects (what ``kubectl describe`` and ``kubectl get events`` show), in the involved
object's namespace, named ``<object>.<nanoseconds hex>`` as client-go names them, source component
``mtc-coordinator``. ``EventRecorder.record`` never blocks and never raises: an event is queued (at most
``QUEUE_LENGTH``; more are dropped with a log line) and sent by ``run``; an API error is logged and the event lost,
as client-go does after its retries. Needs RBAC ``create`` and ``patch`` on ``events`` (the chart's
``coordinator-rbac.yaml``).
"""

import asyncio
import collections
import dataclasses
import datetime
import enum
import logging
import time
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

log = logging.getLogger(__name__)

COMPONENT = "mtc-coordinator"
BURST = 25  # client-go's defaultSpamBurst
REFILL_SECONDS = 300.0  # one token per 5 minutes: client-go's defaultSpamQPS 1/300
SIMILAR_WINDOW_SECONDS = 600.0  # client-go's defaultAggregateIntervalInSeconds
SIMILAR_MAX = 10  # client-go's defaultAggregateMaxEvents
COMBINED_PREFIX = "(combined from similar events): "
CACHE_ENTRIES = 4096  # client-go's maxLruCacheEntries
QUEUE_LENGTH = 1000  # client-go's maxQueuedEvents
# An event not sent within this long (an API server out of reach, a silent connection) is lost: the next is tried.
REQUEST_TIMEOUT_SECONDS = 10.0


class EventType(enum.Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    """The object an event is about (``involvedObject``): a training Pod, a JobSet, a Node.

    Attributes:
      kind, api_version: ``Pod``/``v1``, ``JobSet``/``jobset.x-k8s.io/v1alpha2``, ``Node``/``v1``.
      namespace: the object's; empty for a cluster-scoped object (the event then goes to ``default``).
      name, uid: the object's.
    """

    kind: str
    api_version: str
    namespace: str
    name: str
    uid: str


@dataclasses.dataclass(frozen=True)
class Send:
    """What the correlator decided for one event: create ``name``, or patch it (``count`` > 1).

    Attributes:
      name: the Event object's name.
      message: the message to show (the combined one once aggregated).
      count: how many times it happened; 1 creates the Event.
      first_seen: unix seconds of its first occurrence (``firstTimestamp``).
    """

    name: str
    message: str
    count: int
    first_seen: float


@dataclasses.dataclass
class _Logged:
    name: str
    count: int
    first_seen: float
    last_seen: float


_SimilarKey = tuple[ObjectRef, EventType, str]  # object, type, reason
_LoggedKey = tuple[ObjectRef, EventType, str, str]  # the same and the message (COMBINED_PREFIX once aggregated)


class EventCorrelator:
    """client-go's spam filter, aggregator and logger (see the module docstring), with no I/O: ``correlate`` says
    what to send for each event. Not thread-safe (the coordinator's event loop owns it)."""

    def __init__(self) -> None:
        self._tokens: collections.OrderedDict[ObjectRef, tuple[float, float]] = collections.OrderedDict()
        self._similar: collections.OrderedDict[_SimilarKey, tuple[float, set[str]]] = collections.OrderedDict()
        self._logged: collections.OrderedDict[_LoggedKey, _Logged] = collections.OrderedDict()

    def correlate(self, ref: ObjectRef, type_: EventType, reason: str, message: str, now: float) -> Send | None:
        """What to send for this event at unix time ``now``, or None when the spam filter drops it."""
        if not self._take_token(ref, now):
            return None
        similar_key = (ref, type_, reason)
        since, messages = self._similar.get(similar_key, (now, set()))
        if now - since > SIMILAR_WINDOW_SECONDS:
            since, messages = now, set()
        messages.add(message)
        _put(self._similar, similar_key, (since, messages))
        if len(messages) > SIMILAR_MAX:
            message = COMBINED_PREFIX + message
            key = (ref, type_, reason, COMBINED_PREFIX)  # every further similar event bumps the combined one
        else:
            key = (ref, type_, reason, message)
        logged = self._logged.get(key)
        if logged is not None and now - logged.last_seen <= SIMILAR_WINDOW_SECONDS:
            logged.count += 1
            logged.last_seen = now
            _put(self._logged, key, logged)
            return Send(logged.name, message, logged.count, logged.first_seen)
        logged = _Logged(f"{ref.name}.{time.time_ns():x}", 1, now, now)
        _put(self._logged, key, logged)
        return Send(logged.name, message, 1, now)

    def _take_token(self, ref: ObjectRef, now: float) -> bool:
        tokens, then = self._tokens.get(ref, (float(BURST), now))
        tokens = min(float(BURST), tokens + (now - then) / REFILL_SECONDS)
        allowed = tokens >= 1.0
        _put(self._tokens, ref, (tokens - 1.0 if allowed else tokens, now))
        return allowed


def _put(cache: collections.OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """Stores ``value`` as the newest entry, evicting the oldest past ``CACHE_ENTRIES`` (client-go's LRU)."""
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > CACHE_ENTRIES:
        cache.popitem(last=False)


def _time(unix: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(int(unix), tz=datetime.UTC)


class EventRecorder:
    """Sends the coordinator's events to the API server; ``record`` from anywhere in the event loop, ``run`` as a
    task.

    Args:
      client: the coordinator's lightkube client.
      host: the coordinator's pod or host name (``source.host``).
    """

    def __init__(self, client: AsyncClient, host: str = ""):
        self._client = client
        self._host = host
        self._correlator = EventCorrelator()
        self._queue: asyncio.Queue[tuple[ObjectRef, EventType, str, Send]] = asyncio.Queue(QUEUE_LENGTH)

    def record(self, ref: ObjectRef, type_: EventType, reason: str, message: str) -> None:
        """Queues an event about ``ref``: ``reason`` in CamelCase (``RestoreStarted``), ``message`` one sentence."""
        send = self._correlator.correlate(ref, type_, reason, message, time.time())
        if send is None:
            log.debug("event %s on %s %s/%s dropped by the spam filter", reason, ref.kind, ref.namespace, ref.name)
            return
        try:
            self._queue.put_nowait((ref, type_, reason, send))
        except asyncio.QueueFull:
            log.warning("event queue full (%d): event %s on %s/%s dropped", QUEUE_LENGTH, reason, ref.kind, ref.name)

    async def run(self) -> None:
        """Sends queued events until cancelled."""
        while True:
            ref, type_, reason, send = await self._queue.get()
            try:
                await asyncio.wait_for(self._send(ref, type_, reason, send), REQUEST_TIMEOUT_SECONDS)
            except Exception as error:  # ApiError, a timeout, or the transport's (lightkube's HTTP library's own)
                log.warning("event %s on %s %s/%s not sent: %r", reason, ref.kind, ref.namespace, ref.name, error)
            finally:
                self._queue.task_done()

    async def idle(self) -> None:
        """Returns once every queued event was sent (or failed): for tests and shutdown."""
        await self._queue.join()

    async def _send(self, ref: ObjectRef, type_: EventType, reason: str, send: Send) -> None:
        namespace = ref.namespace or "default"
        now = time.time()
        if send.count > 1:
            patch = {"count": send.count, "message": send.message, "lastTimestamp": _time(now).isoformat()}
            try:
                await self._client.patch(Event, send.name, patch, namespace=namespace, patch_type=PatchType.MERGE)
                return
            except ApiError as error:
                if error.status.code != 404:  # gone (expired after the API server's event TTL): create it anew
                    raise
        involved = ObjectReference(
            kind=ref.kind, apiVersion=ref.api_version, namespace=ref.namespace or None, name=ref.name, uid=ref.uid
        )
        event = Event(
            metadata=ObjectMeta(name=send.name, namespace=namespace),
            involvedObject=involved,
            reason=reason,
            message=send.message,
            type=type_.value,
            count=send.count,
            firstTimestamp=_time(send.first_seen),
            lastTimestamp=_time(now),
            source=EventSource(component=COMPONENT, host=self._host or None),
            reportingComponent=COMPONENT,
            reportingInstance=self._host or None,
        )
        await self._client.create(event)  # the namespace is the event's own (metadata)
