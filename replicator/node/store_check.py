"""The backup store checked at the agent's start (``backup_tier.probe``), and again while it stays unusable.

A store that cannot be written is found within seconds of the agent's start, not three backup intervals later:
one ERROR line in the log, ``mtc_backup_store_usable`` 0, ``backup_store`` in ``/healthz``'s body, and a
``BackupStoreUnusable`` Warning event on the Node (``notices``, sent by the coordinator). The agent
keeps running and stays healthy: a store fault is the same on every node (a bucket, a credential, a network
policy), so failing the liveness probe would restart every agent of the cluster at once, the CSI socket down in
each restart, while the RAM tiers, which do not need the store, are the job's only protection. Backups are still
tried each interval and fail with their own errors until the store is fixed; the probe runs again every
``RECHECK_SECONDS`` until it passes, so the gauge clears without a restart.
"""

import asyncio
import contextlib
import dataclasses
import logging

from prometheus_client import Gauge

from replicator.backup_tier.object_store import ObjectStore
from replicator.backup_tier.probe import ProbeResult, probe_store
from replicator.node.notices import NodeNotices

log = logging.getLogger(__name__)

# Labelled by the store's URL so that the series is absent until a probe ends (and without --backup), never a 0
# that reads as a failure.
STORE_USABLE = Gauge(
    "mtc_backup_store_usable",
    "1 when the backup store passed the agent's write/read/list/delete probe, else 0",
    ["store"],
)
PROBE_TIMEOUT_SECONDS = 30.0  # a store that has not answered by then is unusable for backups (retries included)
RECHECK_SECONDS = 60.0  # between probes of a store found unusable


@dataclasses.dataclass
class StoreCheck:
    """The state of the agent's backup store, as ``/healthz`` and the coordinator's report show it.

    Attributes:
      url: the store, or None without a backup tier.
      result: the last probe's result, or None before the first one ends.
      notices: the node's notices: a store found unusable is a ``BackupStoreUnusable`` event on the Node.
    """

    url: str | None
    result: ProbeResult | None = None
    notices: NodeNotices = dataclasses.field(default_factory=NodeNotices)

    def summary(self) -> str:
        """``"ok"``, ``"unchecked"``, ``"off"`` (no backup tier) or ``"unusable: <error>"``."""
        if self.url is None:
            return "off"
        if self.result is None:
            return "unchecked"
        return "ok" if self.result.usable else f"unusable: {self.result.error}"

    async def run(self, objects: ObjectStore, node_id: str, stop: asyncio.Event) -> None:
        """Probes the store now, then every ``RECHECK_SECONDS`` until it passes or ``stop`` is set."""
        while not stop.is_set():
            result = await _probe_once(objects, node_id)
            was_unusable = self.result is not None and not self.result.usable
            self.result = result
            STORE_USABLE.labels(result.url).set(1 if result.usable else 0)
            if result.usable:
                log.log(
                    logging.WARNING if was_unusable else logging.INFO,
                    "backup store %s usable (probe took %.2f s)",
                    result.url,
                    result.seconds,
                )
                return
            if not was_unusable:
                self.notices.add(
                    "BackupStoreUnusable",
                    f"backup store {result.url} unusable: {result.error}; backups fail until it is fixed",
                )
                log.error(
                    "backup store %s unusable: %s; the RAM tiers keep running, backups fail until it is fixed "
                    "(probed again every %.0f s)",
                    result.url,
                    result.error,
                    RECHECK_SECONDS,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RECHECK_SECONDS)


async def _probe_once(objects: ObjectStore, node_id: str) -> ProbeResult:
    """One probe in a thread, given up after ``PROBE_TIMEOUT_SECONDS`` (the thread ends on its own)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(probe_store, objects, node_id), PROBE_TIMEOUT_SECONDS)
    except TimeoutError:
        return ProbeResult(objects.url, f"no answer within {PROBE_TIMEOUT_SECONDS:.0f} s", PROBE_TIMEOUT_SECONDS)
