"""The coordinator's read-only view of job shapes from the API server: list, then watch, Pods, JobSets and Nodes
with lightkube's ``AsyncClient``, and recompute ``kube_shape.compute_shapes`` on every change that matters.

Only the coordinator watches (10,000 node agents must not each list pods), and it reads only what the shape needs:
- Pods carrying JobSet's ``jobset-name`` label, not finished (a field selector on ``status.phase``); of those, only
  the ones mounting our volume are kept, each as a ``PodRecord``;
- JobSets and Nodes, every one, each kept as its record (the replicatedJobs; the failure-domain labels);
- with per-node identity, the pods of the agents' namespace, by name and UID only: their deletions, and the Nodes',
  are told to ``on_deleted`` (the identity check refuses a token of a deleted pod or node at once).

Each kind is a reflector in the shape of client-go's: a list gives the full set and a resourceVersion, a watch from
that version applies the changes. An error or a silent connection resumes the watch from the last version seen
after a bounded exponential backoff; a ``410 Gone`` (the version is too old) lists again. The set of objects is only
ever replaced by a successful list, so while the API server is unreachable the last known objects, and the shapes
computed from them, stand.
"""

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Hashable
from typing import Any

from lightkube import ALL_NS, ApiError, AsyncClient, operators
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Node, Pod

from replicator.coordinator.kube.kube_shape import (
    JOBSET_NAME,
    ShapeProblem,
    Shapes,
    ShapeSettings,
    compute_shapes,
    read_jobset,
    read_node,
    read_pod,
)

log = logging.getLogger(__name__)

JobSet = create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
"""JobSet v1alpha2 (``sigs.k8s.io/jobset``), as a lightkube generic resource."""


@dataclasses.dataclass(frozen=True)
class WatchSettings:
    """How the watcher talks to the API server.

    Attributes:
      namespace: the one namespace to watch Pods and JobSets in, or None for every namespace.
      backoff_initial_seconds: the first wait after an error; doubled on each further error in a row.
      backoff_max_seconds: the longest wait between attempts (the bound of the backoff): how late, at most, the
        shapes catch up once the API server is back (pods recreated meanwhile wait for them). One watcher per
        cluster, three kinds: a short bound costs the API server nothing.
      server_timeout_seconds: the API server ends each watch request after this long (then it resumes from the
        last version, which keeps the version fresh).
      idle_seconds: a watch with no event for this long is taken as a dead connection and resumed; longer than
        ``server_timeout_seconds``, so a live idle watch ends on the server's side first.
      recompute_delay_seconds: changes within this long of each other are folded into one recomputation.
      shape: what the shape reads (our driver's name, the block label).
      agents_namespace: the namespace of the node agents' pods, whose deletions ``on_deleted`` is told of
        (per-node identity), or None to watch no agent pods.
    """

    namespace: str | None = None
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 5.0
    server_timeout_seconds: int = 240
    idle_seconds: float = 270.0
    recompute_delay_seconds: float = 0.05
    shape: ShapeSettings = dataclasses.field(default_factory=ShapeSettings)
    agents_namespace: str | None = None


@dataclasses.dataclass(frozen=True)
class Deleted:
    """An object the watch saw deleted: a ``DELETED`` event, or gone from a new list after a disconnection.

    Attributes:
      kind: ``Node``, or ``Pod`` (a pod of the agents' namespace).
      name, uid: the object's (a UID is never reused: an object recreated under its name has another).
    """

    kind: str
    name: str
    uid: str


def _read_ref(obj: Any) -> Deleted:
    """A pod of the agents' namespace as what its deletion will be told as."""
    return Deleted("Pod", obj.metadata.name or "", obj.metadata.uid or "")


class Backoff:
    """Exponential waits between attempts, bounded, with up to 10% jitter; ``reset`` after a success."""

    def __init__(self, initial: float, maximum: float, jitter: Callable[[], float] = random.random):
        self.initial, self.maximum, self._jitter = initial, maximum, jitter
        self._next = initial

    def next(self) -> float:
        """The wait before the next attempt (and doubles the one after, up to the bound)."""
        wait = min(self._next, self.maximum)
        self._next = min(self._next * 2, self.maximum)
        return wait * (1 + 0.1 * self._jitter())

    def reset(self) -> None:
        self._next = self.initial


@dataclasses.dataclass(frozen=True)
class _Kind:
    """One kind the watcher reflects: its resource, its selectors, how an object becomes a record and its key;
    ``gone`` names a deleted record for ``on_deleted`` (None: deletions not told); ``shapes``: whether a change
    recomputes the shapes; ``namespace``: the one namespace it is watched in, else the settings' (namespaced)."""

    name: str
    resource: Any
    read: Callable[[Any], Any]
    key: Callable[[Any], Hashable]
    namespaced: bool
    labels: dict[str, Any] | None = None
    fields: dict[str, Any] | None = None
    gone: Callable[[Any], Deleted] | None = None
    shapes: bool = True
    namespace: str | None = None


def _namespaced_key(obj: Any) -> tuple[str, str]:
    return obj.metadata.namespace, obj.metadata.name


def _name_key(obj: Any) -> str:
    name: str = obj.metadata.name
    return name


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class ShapeWatcher:
    """Keeps every job's shape as the API server says, from one list+watch per kind.

    ``run()`` until cancelled; read ``shapes`` (the last computed, never dropped during an outage), wait for a
    condition with ``wait_for``, or pass ``on_change`` to be called with each new ``Shapes``, and ``on_deleted``
    with each Node and agent pod (``WatchSettings.agents_namespace``) deleted.

    Attributes:
      shapes: the last computed shapes (empty until every kind has been listed once).
      version: bumped on every new ``shapes``.
      synced: every kind has been listed at least once.
      connected: by kind name, whether its last list or watch event succeeded (False from its next error on).
      last_error: the newest error talking to the API server, as text, or None.
    """

    def __init__(
        self,
        client: AsyncClient,
        settings: WatchSettings = WatchSettings(),
        on_change: Callable[[Shapes], None] | None = None,
        on_deleted: Callable[[Deleted], None] | None = None,
    ):
        self._client = client
        self._settings = settings
        self._on_change = on_change
        self._on_deleted = on_deleted
        shape = settings.shape
        self._kinds: tuple[_Kind, ...] = (
            _Kind(
                "Pod",
                Pod,
                lambda o: read_pod(o, shape),
                _namespaced_key,
                True,
                labels={JOBSET_NAME: operators.exists()},
                fields={"status.phase": operators.not_in(["Succeeded", "Failed"])},
            ),
            _Kind("JobSet", JobSet, lambda o: read_jobset(o, shape), _namespaced_key, True),
            _Kind(
                "Node",
                Node,
                lambda o: read_node(o, shape),
                _name_key,
                False,
                gone=lambda record: Deleted("Node", record.name, record.uid),
            ),
        )
        if settings.agents_namespace is not None:
            self._kinds += (
                _Kind(
                    "AgentPod",
                    Pod,
                    _read_ref,
                    _namespaced_key,
                    True,
                    gone=lambda record: record,
                    shapes=False,
                    namespace=settings.agents_namespace,
                ),
            )
        self._stores: dict[str, dict[Hashable, Any]] = {kind.name: {} for kind in self._kinds}
        self._listed: set[str] = set()
        self._dirty = asyncio.Event()
        self._changed = asyncio.Condition()
        self._logged: set[ShapeProblem] = set()
        self.shapes = Shapes({}, ())
        self.version = 0
        self.connected = {kind.name: False for kind in self._kinds}
        self.last_error: str | None = None

    @property
    def synced(self) -> bool:
        return len(self._listed) == len(self._kinds)

    async def run(self) -> None:
        """Reflects every kind and recomputes the shapes, until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            for kind in self._kinds:
                tasks.create_task(self._reflect(kind), name=f"watch {kind.name}")
            tasks.create_task(self._recompute(), name="recompute shapes")

    async def wait_for(self, condition: Callable[[Shapes], bool], timeout: float) -> Shapes:
        """The shapes once ``condition`` holds for them.

        Raises:
          TimeoutError: it did not hold within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.synced and condition(self.shapes))
            return self.shapes

    # --- one kind: list, then watch -------------------------------------------------------------------------------

    async def _reflect(self, kind: _Kind) -> None:
        backoff = Backoff(self._settings.backoff_initial_seconds, self._settings.backoff_max_seconds)
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list(kind)
                version = await self._watch(kind, version, backoff)
            except _Gone:
                log.info("%s watch: resourceVersion %s is too old, listing again", kind.name, version)
                version = None
            except Exception as error:
                if isinstance(error, ApiError) and error.status.code == 410:
                    version = None
                    continue
                self.connected[kind.name] = False
                self.last_error = f"{kind.name}: {type(error).__name__}: {error}"
                wait = backoff.next()
                log.warning(
                    "%s list/watch failed (%s); the last known objects stand; retrying in %.1f s",
                    kind.name,
                    self.last_error,
                    wait,
                )
                await asyncio.sleep(wait)

    def _namespace(self, kind: _Kind) -> dict[str, Any]:
        """The ``namespace`` argument of ``kind``'s list and watch (none for a cluster-wide kind)."""
        return {"namespace": kind.namespace or self._settings.namespace or ALL_NS} if kind.namespaced else {}

    def _changed_kind(self, kind: _Kind) -> None:
        if kind.shapes:
            self._dirty.set()

    def _deleted(self, kind: _Kind, record: Any) -> None:
        if kind.gone is not None and self._on_deleted is not None:
            gone = kind.gone(record)
            log.info("%s %s (UID %s) was deleted", gone.kind, gone.name, gone.uid)
            self._on_deleted(gone)

    async def _list(self, kind: _Kind) -> str:
        """Lists ``kind`` and replaces its store (telling of the records gone since); returns the list's
        resourceVersion."""
        namespace = self._namespace(kind)
        listing = self._client.list(kind.resource, labels=kind.labels, fields=kind.fields, chunk_size=500, **namespace)
        fresh = {}
        async for obj in listing:
            record = kind.read(obj)
            if record is not None:
                fresh[kind.key(obj)] = record
        self.connected[kind.name] = True
        old = self._stores[kind.name]
        if fresh != old or kind.name not in self._listed:
            if kind.gone is not None:
                uids = {kind.gone(record).uid for record in fresh.values()}
                for record in old.values():
                    if kind.gone(record).uid not in uids:  # deleted while the watch was down
                        self._deleted(kind, record)
            self._stores[kind.name] = fresh
            if kind.shapes or kind.name not in self._listed:  # the first list may complete the sync
                self._dirty.set()
            self._listed.add(kind.name)
        return listing.resourceVersion

    async def _watch(self, kind: _Kind, version: str, backoff: Backoff) -> str:
        """Applies ``kind``'s changes from ``version`` on; returns the last version seen when the watch goes idle."""
        namespace = self._namespace(kind)
        store = self._stores[kind.name]
        events = self._client.watch(
            kind.resource,
            labels=kind.labels,
            fields=kind.fields,
            resource_version=version,
            server_timeout=self._settings.server_timeout_seconds,
            **namespace,
        )
        try:
            async with asyncio.timeout(self._settings.idle_seconds) as idle:
                async for event, obj in events:
                    idle.reschedule(asyncio.get_running_loop().time() + self._settings.idle_seconds)
                    backoff.reset()
                    self.connected[kind.name] = True
                    version = obj.metadata.resourceVersion or version
                    key = kind.key(obj)
                    record = None if event == "DELETED" else kind.read(obj)
                    if record is None:
                        if (old := store.pop(key, None)) is not None:
                            self._changed_kind(kind)
                            if event == "DELETED":
                                self._deleted(kind, old)
                    elif store.get(key) != record:
                        store[key] = record
                        self._changed_kind(kind)
        except ApiError as error:
            if error.status.code == 410:
                raise _Gone() from None
            raise
        except TimeoutError:
            log.info("%s watch: no event for %.0f s, resuming from %s", kind.name, self._settings.idle_seconds, version)
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # an async generator, typed AsyncIterable by lightkube
        return version

    # --- the shapes ---------------------------------------------------------------------------------------------------

    async def _recompute(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self._settings.recompute_delay_seconds)
            self._dirty.clear()
            if not self.synced:
                continue
            started = time.monotonic()
            shapes = compute_shapes(
                self._stores["Pod"].values(), self._stores["Node"].values(), self._stores["JobSet"].values()
            )
            elapsed = time.monotonic() - started
            if elapsed > 0.5:
                log.info("job shapes recomputed in %.2f s (%d pods)", elapsed, len(self._stores["Pod"]))
            self._log_problems(shapes.problems)
            if shapes == self.shapes and self.version:
                continue
            async with self._changed:
                self.shapes = shapes
                self.version += 1
                self._changed.notify_all()
            if self._on_change is not None:
                self._on_change(shapes)

    def _log_problems(self, problems: tuple[ShapeProblem, ...]) -> None:
        """Logs each problem once, when it first appears; one that went away is logged again if it comes back."""
        current = set(problems)
        for problem in problems:
            if problem not in self._logged:
                log.warning("refused: %s", problem)
        self._logged = current
