"""The pod's start-up hand-shake through its framework's files: the rank file once the pod has a rank
(Orbax's ``jax-init-info.txt``), then ``replicator.yaml`` validated, recorded with the coordinator and
consumed (or refused through ``replicator.failed``). The file formats are the job's ``Framework``'s."""

import logging

from prometheus_client import Counter

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier import pod_files
from replicator.local_tier.frameworks import InvalidReplicatorConfig
from replicator.local_tier.job_keys import job_of
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.log_once import LogOnce
from replicator.wire.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from replicator.wire.messages import Assignment

log = logging.getLogger(__name__)

REPLICATOR_YAML = Counter("mtc_replicator_yaml_total", "replicator.yaml files consumed", ["result"])


def current_pod(disk: Ramdisk):
    """The newest publication of the ramdisk: the job's pod on this node (one per node)."""
    return max(disk.publications.values(), key=lambda p: p.published_at).spec if disk.publications else None


def apply_assignment(disk: Ramdisk, meta: JobMeta, progress: PodProgress, assignment: Assignment | None) -> PodProgress:
    """Writes ``jax-init-info.txt`` for a new assignment (None: the coordinator gave the pod none);
    returns the pod's progress after it."""
    if assignment is None or assignment.incarnation == progress.incarnation:
        return progress
    meta.framework.write_init_info(disk.client_dir, assignment.rank, assignment.jax_coordinator)
    progress = PodProgress(progress.pod_uid, assignment.incarnation, assignment.rank, assignment.jax_coordinator, jax_init_written=True)
    meta.save_progress(progress)
    log.info("%s/%s: pod %s is rank %d of incarnation %s (JAX coordinator %s)",
             disk.namespace, disk.job, progress.pod_uid, assignment.rank, assignment.incarnation, assignment.jax_coordinator)  # fmt: skip
    return progress


async def consume_replicator_yaml(client: CoordinatorClient, disk: Ramdisk, meta: JobMeta, progress: PodProgress, nodes: int,
                                  log_once: LogOnce) -> None:  # fmt: skip
    """Validates the job's ``replicator.yaml`` (if written yet), records its settings with the
    coordinator and in ``progress``, then consumes it; bad content goes to ``replicator.failed``.
    An unreachable coordinator leaves the file for the next pass."""
    framework = meta.framework
    try:
        text = framework.read_config(disk.client_dir)
        if text is None:
            return
        settings = framework.parse_config(text, progress.rank, nodes)
    except (InvalidReplicatorConfig, pod_files.UnsafeEntry, UnicodeDecodeError) as err:
        message = str(err) if isinstance(err, InvalidReplicatorConfig) else f"replicator.yaml is unusable: {err}"
        log.error("%s/%s: rejected replicator.yaml: %s", disk.namespace, disk.job, message)
        framework.report_failure(disk.client_dir, meta.root, message)
        framework.consume_config(disk.client_dir)  # Orbax reads replicator.failed only once the yaml is gone
        REPLICATOR_YAML.labels("rejected").inc()
        return
    try:
        await client.record_settings(progress.pod_rank(job_of(disk)), settings)
    except CoordinatorUnavailable as err:
        log_once(f"settings-{disk.job}", f"cannot record job settings with the coordinator, retrying: {err}", meta)
        return
    progress.settings = settings
    meta.save_progress(progress)
    framework.consume_config(disk.client_dir)
    REPLICATOR_YAML.labels("accepted").inc()
    log.info("%s/%s rank %d: consumed replicator.yaml %s", disk.namespace, disk.job, progress.rank, settings)
