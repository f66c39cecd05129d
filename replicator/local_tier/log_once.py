"""Errors the node agent tells a job about: ``replicator.errors`` in its client dir, throttled per key."""

import logging
import time

from replicator.local_tier.job_meta import JobMeta
from replicator.pacing.timing import ERROR_REPEAT_SECONDS

log = logging.getLogger(__name__)


def report_to_job(meta: JobMeta, message: str) -> None:
    """Appends ``message`` to the job's ``replicator.errors`` (its content kept in ``meta``)."""
    meta.framework.report_error(meta.client_dir, meta.root, message)


class LogOnce:
    """Logs a repeated error (and reports it to the job) at most every ``ERROR_REPEAT_SECONDS`` per key."""

    def __init__(self):
        self._last_error: dict[str, float] = {}  # key -> monotonic time it was last logged

    def __call__(self, key: str, message: str, meta: JobMeta | None = None) -> None:
        """Logs ``message`` unless ``key`` was logged within the period; with ``meta``, also
        appends it to that job's ``replicator.errors``."""
        now = time.monotonic()
        if now - self._last_error.get(key, -ERROR_REPEAT_SECONDS) >= ERROR_REPEAT_SECONDS:
            self._last_error[key] = now
            log.warning("%s", message)
            if meta is not None:
                report_to_job(meta, message)
