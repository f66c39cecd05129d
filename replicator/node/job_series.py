"""The per-job series of a node agent's ``/metrics``: they exist, at zero, from a job's first
publish on the node, and go when its ramdisk leaves it, so their number follows the jobs on the
node (a few), never the files or steps."""

import threading

from prefetch import restore
from replicator.backup_tier.worker import BACKUP_IN_FLIGHT


class JobSeries:
    """Which jobs have series on this node."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: set[tuple[str, str]] = set()

    def seed(self, namespace: str, job: str) -> None:
        """Creates the job's series at zero (at publish: before its restore, which counts in them)."""
        with self._lock:
            self._jobs.add((namespace, job))
        restore.seed_job_series(namespace, job)
        BACKUP_IN_FLIGHT.seed(namespace, job)

    def keep_only(self, jobs: set[tuple[str, str]]) -> None:
        """Removes the series of jobs not in ``jobs`` ((namespace, job) of the node's ramdisks) and
        seeds those of ``jobs`` (a restarted agent finds its ramdisks without a publish)."""
        with self._lock:
            gone, self._jobs = self._jobs - jobs, set(jobs)
        for namespace, job in gone:
            restore.forget_job_series(namespace, job)
            BACKUP_IN_FLIGHT.forget(namespace, job)
        for namespace, job in jobs:
            restore.seed_job_series(namespace, job)
            BACKUP_IN_FLIGHT.seed(namespace, job)
