"""Elastic restores: a PyTorch job (``mtc_torch``) that comes back on another node count restores its
newest step resharded. What the coordinator adds to a restore plan for it; ``planner.plan_restore`` plans.

The job tells its new shape only through its node count: the volume's ``nodes`` attribute, which its
``replicator.yaml`` ``nodes`` must equal (``frameworks.client_dir.check_job_shape``). A step saved at
another count is reshardable when every old node's own report of it is known and holds ``mtc_torch``'s
layout (``rank-<r>-of-<W>/`` only): its reader (``mtc_torch.StepReader``) loads a directory of several
old nodes' copies, ``node-<n>-of-<N>/rank-<r>-of-<W>/``, into any world size, and refuses a load those
copies do not cover. A step that is not reshardable is planned as before (its node count assumed).
"""

import re

from replicator.coordinator.indices.job import JobState
from replicator.wire.messages import Files

# ``mtc_torch``'s node step: one DCP checkpoint per local rank (``frameworks.pytorch``'s commit evidence).
_MTC_TORCH_PATH = re.compile(r"^rank-[0-9]{1,6}-of-[0-9]{1,6}/", re.ASCII)


def reshards(job: JobState) -> bool:
    """Whether the job's launcher fixes its ranks (torchrun: ``ranks_follow_data`` False), the one
    kind of job whose client reshards a step."""
    return any(not pod.ranks_follow_data for pod, _ in job.pods.values())


def saved_shapes(job: JobState, nodes: int) -> dict[int, int]:
    """Step -> the node count it was saved at, for the steps saved at another count than ``nodes`` that
    the job can load resharded: every old rank's own checksums known and of ``mtc_torch``'s layout.

    The count is one more than the highest rank whose own node reported the step; a step whose
    highest ranks' reports were all lost looks smaller, and its restore is refused by the job's
    reader (it does not cover the tensors), never partial. Cost: one pass over the job's owner
    reports, and one unpack per old rank of the steps whose count differs; run once per plan.
    """
    ranks_of: dict[int, list[int]] = {}
    for step, rank in job.owners.files:
        ranks_of.setdefault(step, []).append(rank)
    shapes = {}
    for step, ranks in ranks_of.items():
        count = max(ranks) + 1
        if count != nodes and len(ranks) == count and all(_mtc_torch(job.owners.checksums(step, r)) for r in ranks):
            shapes[step] = count
    return shapes


def _mtc_torch(files: Files | None) -> bool:
    return files is not None and bool(files) and all(_MTC_TORCH_PATH.match(path) for path in files)
