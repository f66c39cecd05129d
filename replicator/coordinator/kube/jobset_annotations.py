"""Is my job protected? The coordinator (``--kube``) writes each job's safe and backed-up steps as annotations on its
JobSet, so that ``kubectl get jobset`` answers without ``mtc status``.

``mtc.dev/safe-step`` is the newest step whose every rank's data exists in two places (``ClusterState.safe_step``:
what survives a node loss); ``mtc.dev/backed-up-step`` the newest complete backup of the job's lineage (what
survives losing the cluster); ``mtc.dev/restoring`` ``"true"`` while the job's restore stages, else ``"false"``.
An annotation is absent until its step exists. Annotations, not conditions in the JobSet's status: the status is
the JobSet controller's, which writes it whole, and a CRD of our own would be one more object per job to create,
own and delete. A job's annotations are patched (a JSON merge patch of the three) when they change, at most once
every ``MIN_INTERVAL_SECONDS``: a job saving every second costs the API server one write per 5 s, not one a second.
Needs RBAC ``patch`` on ``jobsets``.
"""

import asyncio
import logging
import time

from lightkube import AsyncClient
from lightkube.types import PatchType

from replicator.coordinator.kube.kube_shape import Shapes
from replicator.coordinator.kube.kube_watch import JobSet
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import JobRef

log = logging.getLogger(__name__)

SAFE_STEP = "mtc.dev/safe-step"
BACKED_UP_STEP = "mtc.dev/backed-up-step"
RESTORING = "mtc.dev/restoring"
MIN_INTERVAL_SECONDS = 5.0
# A request to an API server out of reach (a silent connection) is given up after this long: the next waits.
REQUEST_TIMEOUT_SECONDS = 10.0

Annotations = dict[str, str | None]  # None removes the annotation (a merge patch)


def annotations_of(state: ClusterState, key: JobRef) -> Annotations:
    """The job's three annotations as they should read now."""
    safe, backed = state.safe_step(key), state.backed_up(key)
    incarnation = state.job(key).incarnation
    plan = incarnation.plan if incarnation is not None else None
    restoring = (
        incarnation is not None
        and plan is not None
        and plan.step is not None
        and len(incarnation.staged) < len(incarnation.node_of_rank)
    )
    return {
        SAFE_STEP: None if safe is None else str(safe),
        BACKED_UP_STEP: str(max(backed)) if backed else None,
        RESTORING: "true" if restoring else "false",
    }


class JobSetAnnotations:
    """Writes each JobSet's annotations when they change (``publish`` each tick; ``run`` as a task)."""

    def __init__(self, client: AsyncClient):
        self._client = client
        self._written: dict[tuple[str, str], Annotations] = {}  # (namespace, JobSet) -> as last written
        self._due: dict[tuple[str, str], Annotations] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._wake = asyncio.Event()

    def publish(self, state: ClusterState, shapes: Shapes) -> None:
        """Notes every JobSet whose annotations differ from those last written."""
        current = set()
        for key, shape in shapes.jobs.items():
            jobset = (key.namespace, shape.jobset)
            current.add(jobset)
            try:
                wanted = annotations_of(state, key)
            except KeyError:  # a JobSet whose pods have not reported yet: nothing to say
                continue
            if self._written.get(jobset) != wanted:
                self._due[jobset] = wanted
                self._wake.set()
        for gone in self._written.keys() - current:  # a deleted JobSet
            del self._written[gone]
            self._last.pop(gone, None)

    async def run(self) -> None:
        """Patches due JobSets until cancelled, each at most once every ``MIN_INTERVAL_SECONDS``."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            later = [j for j in self._due if now - self._last.get(j, -MIN_INTERVAL_SECONDS) < MIN_INTERVAL_SECONDS]
            for jobset in [j for j in self._due if j not in later]:
                await self._patch(jobset, self._due.pop(jobset), now)
            if later:
                asyncio.get_running_loop().call_later(MIN_INTERVAL_SECONDS / 5, self._wake.set)

    async def _patch(self, jobset: tuple[str, str], wanted: Annotations, now: float) -> None:
        namespace, name = jobset
        self._last[jobset] = now
        patch = {"metadata": {"annotations": wanted}}
        try:
            await asyncio.wait_for(
                self._client.patch(JobSet, name, patch, namespace=namespace, patch_type=PatchType.MERGE),
                REQUEST_TIMEOUT_SECONDS,
            )
            self._written[jobset] = wanted
        except Exception as error:  # ApiError, a timeout, the transport's: the next tick finds it due again
            log.warning("JobSet %s/%s: annotations not written: %r", namespace, name, error)
