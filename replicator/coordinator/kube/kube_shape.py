"""Job shapes from the API server's objects: a pure function from Pods, Nodes and JobSets to each job's shape.

No I/O. The watcher (``kube_watch.py``) reads the objects at its edge into the frozen records below
(``read_pod``, ``read_node``, ``read_jobset``) and recomputes with ``compute_shapes`` on every change.

What a shape holds, per job key (``JobRef``: the pod's namespace and the job its volume names):
- ``nodes``: the number of pods the JobSet runs that mount our CSI volume: the sum, over the replicatedJobs whose pod
  template mounts it and that share the key, of ``replicas x parallelism``. A replicatedJob without our volume (a
  driver, a parameter server) counts for nothing.
- ``slices``: the sum of their ``replicas``. A slice is one Job of a replicatedJob: its index is the pod's
  ``jobset.sigs.k8s.io/job-index`` annotation, offset by the replicas of the replicatedJobs sharing the key that come
  before it in ``spec.replicatedJobs`` (so ``workers-a`` with 2 replicas holds slices 0-1 and ``workers-b`` after it
  holds 2-3). JobSet's ``job-global-index`` is not used: it counts the replicatedJobs without our volume too.
- each pod's ``worker``: ``batch.kubernetes.io/job-completion-index``; its DNS name ``<spec.hostname>.<spec.subdomain>``
  (JobSet's headless Service is named after the JobSet, or ``spec.network.subdomain``); its IP; its node; the node's
  failure domains from its labels.

The job key is the one the CSI driver derives today (``csi_driver/volume_request.py``): the volume's ``job``
attribute, else ``<jobset>-<replicatedJob>``. Bad data never raises: it becomes a ``ShapeProblem`` naming the object
and the field, and the pod (or, for a contradiction in the JobSet itself, the job) is left out of the shapes.
"""

import dataclasses
import re
import types
from collections.abc import Iterable, Mapping
from typing import Any

from replicator.wire.messages import JobRef

DRIVER = "ramdisk.csi.mtc.dev"
"""Our CSI driver's name (``manifests/csidriver.yaml``)."""

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
ZONE_LABEL = "topology.kubernetes.io/zone"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
DEFAULT_BLOCK_LABEL = "cloud.google.com/gce-topology-block"

_INDEX = re.compile(r"[0-9]{1,9}", re.ASCII)
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclasses.dataclass(frozen=True)
class ShapeSettings:
    """What the shape reads beyond the fixed JobSet and Job keys.

    Attributes:
      driver: the CSI driver whose volumes make a pod part of a job.
      block_label: the node label naming a node's block or rack (the third failure domain).
    """

    driver: str = DRIVER
    block_label: str = DEFAULT_BLOCK_LABEL


# --- Records: each object read once, at the edge, into what the shape needs -----------------------------------


@dataclasses.dataclass(frozen=True)
class PodRecord:
    """A pod that mounts our CSI volume, as the API server has it; values raw (checked by ``compute_shapes``).

    Attributes:
      namespace, name, uid: the pod's.
      jobset: its ``jobset-name`` annotation, or None.
      jobset_uid: its ``jobset-uid`` label (or annotation), or None.
      replicated_job: its ``replicatedjob-name`` annotation, or None.
      job_index: its ``job-index`` annotation, or None.
      completion_index: its ``job-completion-index`` annotation, or None.
      restart_attempt: its ``restart-attempt`` annotation, or None.
      hostname, subdomain: ``spec.hostname`` and ``spec.subdomain``, or None.
      ip: ``status.podIP``, or None.
      node: ``spec.nodeName``, or None while unscheduled.
      attributes: the ``volumeAttributes`` of its (first) volume of our driver.
      live: neither being deleted nor in a terminal phase.
    """

    namespace: str
    name: str
    uid: str
    jobset: str | None
    jobset_uid: str | None
    replicated_job: str | None
    job_index: str | None
    completion_index: str | None
    restart_attempt: str | None
    hostname: str | None
    subdomain: str | None
    ip: str | None
    node: str | None
    attributes: Mapping[str, str]
    live: bool


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """A node's failure domains, from its labels (None where the label is absent), and its UID (a node recreated
    under its name is another node)."""

    name: str
    zone: str | None
    nodepool: str | None
    block: str | None
    uid: str = ""


@dataclasses.dataclass(frozen=True)
class ReplicatedJobRecord:
    """One replicatedJob of a JobSet.

    Attributes:
      name: its name.
      replicas: its Jobs (slices), raw from the spec.
      parallelism, completions: its Job template's, raw (None when absent).
      indexed: the Job template's ``completionMode`` is ``Indexed``.
      mounts: its pod template mounts a volume of our driver.
      job: the ``job`` volume attribute of that volume, or None.
    """

    name: str
    replicas: Any
    parallelism: Any
    completions: Any
    indexed: bool
    mounts: bool
    job: str | None


@dataclasses.dataclass(frozen=True)
class JobSetRecord:
    """A JobSet: its identity, the subdomain its pods resolve under, and its replicatedJobs in spec order."""

    namespace: str
    name: str
    uid: str
    subdomain: str
    replicated_jobs: tuple[ReplicatedJobRecord, ...]


def _as_dict(obj: Any) -> Mapping[str, Any]:
    """A plain dict of ``obj``: a lightkube model (typed, or generic, which is a dict holding models) through
    ``to_dict``, a dict as it is."""
    to_dict = getattr(obj, "to_dict", None)
    if to_dict is not None:
        as_dict: Mapping[str, Any] = to_dict()
        return as_dict
    return obj if isinstance(obj, Mapping) else {}


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    found: Any = obj
    for key in path:
        if not isinstance(found, Mapping):
            return None
        found = found.get(key)
    return found


def _our_volume(pod_spec: Mapping[str, Any] | None, driver: str) -> Mapping[str, Any] | None:
    """The ``csi`` block of the first volume of ``driver`` in a pod spec, or None."""
    for volume in _get(pod_spec or {}, "volumes") or ():
        csi = _get(volume, "csi")
        if isinstance(csi, Mapping) and csi.get("driver") == driver:
            return csi
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def read_pod(obj: Any, settings: ShapeSettings = ShapeSettings()) -> PodRecord | None:
    """The record of a pod (a dict or a lightkube ``Pod``), or None when it mounts no volume of our driver."""
    pod = _as_dict(obj)
    volume = _our_volume(_get(pod, "spec"), settings.driver)
    if volume is None:
        return None
    meta = _get(pod, "metadata") or {}
    annotations = _get(meta, "annotations") or {}
    labels = _get(meta, "labels") or {}
    attributes = volume.get("volumeAttributes") or {}
    return PodRecord(
        namespace=_text(meta.get("namespace")) or "default",
        name=_text(meta.get("name")) or "",
        uid=_text(meta.get("uid")) or "",
        jobset=_text(annotations.get(JOBSET_NAME)),
        jobset_uid=_text(labels.get(JOBSET_UID)) or _text(annotations.get(JOBSET_UID)),
        replicated_job=_text(annotations.get(REPLICATED_JOB)),
        job_index=_text(annotations.get(JOB_INDEX)),
        completion_index=_text(annotations.get(COMPLETION_INDEX)),
        restart_attempt=_text(annotations.get(RESTART_ATTEMPT)),
        hostname=_text(_get(pod, "spec", "hostname")),
        subdomain=_text(_get(pod, "spec", "subdomain")),
        ip=_text(_get(pod, "status", "podIP")),
        node=_text(_get(pod, "spec", "nodeName")),
        attributes=types.MappingProxyType({str(k): str(v) for k, v in attributes.items()}),
        live=meta.get("deletionTimestamp") is None and _get(pod, "status", "phase") not in _TERMINAL_PHASES,
    )


def read_node(obj: Any, settings: ShapeSettings = ShapeSettings()) -> NodeRecord:
    """The failure domains of a node (a dict or a lightkube ``Node``)."""
    node = _as_dict(obj)
    labels = _get(node, "metadata", "labels") or {}
    return NodeRecord(
        name=_text(_get(node, "metadata", "name")) or "",
        zone=_text(labels.get(ZONE_LABEL)),
        nodepool=_text(labels.get(NODEPOOL_LABEL)),
        block=_text(labels.get(settings.block_label)),
        uid=_text(_get(node, "metadata", "uid")) or "",
    )


def read_jobset(obj: Any, settings: ShapeSettings = ShapeSettings()) -> JobSetRecord:
    """A JobSet (a dict or a lightkube generic resource) as its replicatedJobs and the subdomain of its pods."""
    jobset = _as_dict(obj)
    meta = _get(jobset, "metadata") or {}
    name = _text(meta.get("name")) or ""
    replicated = []
    for entry in _get(jobset, "spec", "replicatedJobs") or ():
        job_spec = _get(entry, "template", "spec") or {}
        volume = _our_volume(_get(job_spec, "template", "spec"), settings.driver)
        replicated.append(
            ReplicatedJobRecord(
                name=_text(_get(entry, "name")) or "",
                replicas=_get(entry, "replicas") if _get(entry, "replicas") is not None else 1,
                parallelism=job_spec.get("parallelism") if job_spec.get("parallelism") is not None else 1,
                completions=job_spec.get("completions"),
                indexed=job_spec.get("completionMode") == "Indexed",
                mounts=volume is not None,
                job=_text(_get(volume or {}, "volumeAttributes", "job")) or None,
            )
        )
    return JobSetRecord(
        namespace=_text(meta.get("namespace")) or "default",
        name=name,
        uid=_text(meta.get("uid")) or "",
        subdomain=_text(_get(jobset, "spec", "network", "subdomain")) or name,
        replicated_jobs=tuple(replicated),
    )


# --- Shapes --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FailureDomains:
    """Where a node sits, from its labels: zone, node pool (the managed product's slice), block or rack."""

    zone: str | None
    nodepool: str | None
    block: str | None


@dataclasses.dataclass(frozen=True)
class PodPlace:
    """One pod of a job's shape.

    Attributes:
      name, uid: the pod's.
      slice: its slice (see the module docstring for several replicatedJobs).
      worker: its index within the slice (the Job's completion index).
      dns_name: ``<spec.hostname>.<spec.subdomain>``, or None when JobSet set no DNS hostnames.
      ip: its pod IP, or None before the kubelet reports one.
      node: the node it is bound to, or None while unscheduled.
      domains: that node's failure domains, or None when the node is unknown.
    """

    name: str
    uid: str
    slice: int
    worker: int
    dns_name: str | None
    ip: str | None
    node: str | None
    domains: FailureDomains | None


@dataclasses.dataclass(frozen=True)
class JobShape:
    """A job's shape, as the API server says.

    Attributes:
      job: the job key.
      jobset: the JobSet's name; jobset_uid: its UID.
      replicated_jobs: the replicatedJobs whose pods make up the job, in spec order.
      nodes: the pods the JobSet runs for this job (sum of replicas x parallelism).
      slices: its slices (sum of replicas); nodes_per_slice: each slice's pods (parallelism).
      pods: the live pods seen so far, by (slice, worker); fewer than ``nodes`` while pods are being created.
    """

    job: JobRef
    jobset: str
    jobset_uid: str
    replicated_jobs: tuple[str, ...]
    nodes: int
    slices: int
    nodes_per_slice: int
    pods: tuple[PodPlace, ...]


@dataclasses.dataclass(frozen=True)
class ShapeProblem:
    """Bad or missing data, naming the object and the field.

    Attributes:
      kind: ``Pod`` or ``JobSet``.
      namespace, name: the object's.
      field: the annotation, attribute or spec field at fault.
      reason: what is wrong, in a sentence.
    """

    kind: str
    namespace: str
    name: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}: {self.field}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Every job's shape and every problem found, from one set of objects.

    Attributes:
      jobs: each job key's shape.
      problems: bad or missing data; a pod named here is in no shape, a JobSet named here gives no shape.
      domains: every node's failure domains, by node name.
    """

    jobs: Mapping[JobRef, JobShape]
    problems: tuple[ShapeProblem, ...]
    domains: Mapping[str, FailureDomains] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))


@dataclasses.dataclass(frozen=True)
class _Group:
    """The replicatedJobs of one JobSet sharing a job key, with each one's first slice."""

    jobset: JobSetRecord
    members: tuple[ReplicatedJobRecord, ...]
    first_slice: Mapping[str, int]
    replicas: Mapping[str, int]
    nodes_per_slice: int


def job_key(jobset: str, replicated_job: str, job_attribute: str | None) -> str:
    """The job name the CSI driver derives for a pod of ``replicated_job``: its ``job`` attribute, else
    ``<jobset>-<replicatedJob>`` (the name its pods' names start with)."""
    return job_attribute or f"{jobset}-{replicated_job}"


def _count(value: Any, minimum: int) -> int | None:
    """A spec count as an int (>= ``minimum``), or None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return None
    return value


def _jobset_problem(jobset: JobSetRecord, field: str, reason: str) -> ShapeProblem:
    return ShapeProblem("JobSet", jobset.namespace, jobset.name, field, reason)


def _groups(jobset: JobSetRecord, problems: list[ShapeProblem]) -> dict[JobRef, _Group]:
    """A JobSet's mounting replicatedJobs by job key; contradictions in the JobSet itself become problems and
    their key gets no group."""
    by_key: dict[str, list[tuple[int, ReplicatedJobRecord]]] = {}
    for position, rj in enumerate(jobset.replicated_jobs):
        if rj.mounts:
            by_key.setdefault(job_key(jobset.name, rj.name, rj.job), []).append((position, rj))
    groups = {}
    for key, members in by_key.items():
        group = _group(jobset, key, members, problems)
        if group is not None:
            groups[JobRef(jobset.namespace, key)] = group
    return groups


def _group(
    jobset: JobSetRecord, key: str, members: list[tuple[int, ReplicatedJobRecord]], problems: list[ShapeProblem]
) -> _Group | None:
    """The group of the replicatedJobs sharing job ``key``, each with its position in the spec; None when any
    of them, or the key, has a problem (each appended to ``problems``)."""
    first_slice, replicas, per_slice, bad = {}, {}, set(), False
    slices = 0
    for position, rj in members:
        counts = _member_counts(jobset, position, rj, problems)
        if counts is None:
            bad = True
        else:
            first_slice[rj.name], replicas[rj.name] = slices, counts[0]
            slices += counts[0]
            per_slice.add(counts[1])
    if len(per_slice) > 1:
        names = ", ".join(rj.name for _, rj in members)
        problems.append(
            _jobset_problem(
                jobset,
                "spec.replicatedJobs",
                f"replicatedJobs {names} share job {key!r} with different parallelism "
                f"{sorted(per_slice)}: a job's slices must be the same size",
            )
        )
        bad = True
    if not _DNS1123_LABEL.match(key):
        problems.append(
            _jobset_problem(
                jobset,
                "spec.replicatedJobs",
                f"job {key!r} is not a DNS-1123 label: the CSI driver refuses its pods; "
                "set a shorter volume attribute job",
            )
        )
        bad = True
    if bad:
        return None
    return _Group(jobset, tuple(rj for _, rj in members), first_slice, replicas, per_slice.pop() if per_slice else 1)


def _member_counts(
    jobset: JobSetRecord, position: int, rj: ReplicatedJobRecord, problems: list[ShapeProblem]
) -> tuple[int, int] | None:
    """A mounting replicatedJob's (replicas, parallelism); None when its spec has a problem (the first one
    found appended to ``problems``)."""
    field = f"spec.replicatedJobs[{position}]"
    count, parallelism = _count(rj.replicas, 0), _count(rj.parallelism, 1)
    completions = parallelism if rj.completions is None else _count(rj.completions, 1)
    if count is None:
        fault = (f"{field}.replicas", f"{rj.replicas!r} is not a count")
    elif parallelism is None:
        fault = (f"{field}.template.spec.parallelism", f"{rj.parallelism!r} is not a positive count")
    elif not rj.indexed:
        fault = (
            f"{field}.template.spec.completionMode",
            "must be Indexed: a pod's worker index is its Job completion index",
        )
    elif completions != parallelism:
        fault = (
            f"{field}.template.spec.completions",
            f"{rj.completions!r} differs from parallelism {parallelism}: every worker of a slice must run at once",
        )
    else:
        return count, parallelism
    problems.append(_jobset_problem(jobset, *fault))
    return None


def _index(value: str | None, bound: int) -> int | None:
    if value is None or not _INDEX.fullmatch(value):
        return None
    index = int(value)
    return index if index < bound else None


def _pod_problem(pod: PodRecord, field: str, reason: str) -> ShapeProblem:
    return ShapeProblem("Pod", pod.namespace, pod.name, field, reason)


def _place(
    pod: PodRecord,
    jobsets: Mapping[tuple[str, str], JobSetRecord],
    groups: Mapping[JobRef, _Group],
    nodes: Mapping[str, FailureDomains],
) -> tuple[JobRef, PodPlace] | ShapeProblem:
    """A pod's place in its job, or the first problem with it."""
    jobset = _jobset_of(pod, jobsets)
    if isinstance(jobset, ShapeProblem):
        return jobset
    rj = _replicated_job_of(pod, jobset)
    if isinstance(rj, ShapeProblem):
        return rj
    key = JobRef(pod.namespace, job_key(jobset.name, rj.name, pod.attributes.get("job") or None))
    template_key = JobRef(pod.namespace, job_key(jobset.name, rj.name, rj.job))
    if key != template_key:
        return _pod_problem(
            pod, "volume attribute job", f"{key.job!r} contradicts its replicatedJob template's {template_key.job!r}"
        )
    group = groups.get(key)
    if group is None or (group.jobset.name, group.jobset.uid) != (jobset.name, jobset.uid):  # another JobSet's key
        return _pod_problem(
            pod,
            f"JobSet {jobset.name}",
            f"the JobSet's spec gives job {key.job!r} no shape (see the JobSet's problem)",
        )
    replicas = group.replicas[rj.name]
    job_index = _index(pod.job_index, replicas)
    if job_index is None:
        return _pod_problem(
            pod, f"annotation {JOB_INDEX}", f"{pod.job_index!r} is not an index below replicas {replicas}"
        )
    worker = _index(pod.completion_index, group.nodes_per_slice)
    if worker is None:
        return _pod_problem(
            pod,
            f"annotation {COMPLETION_INDEX}",
            f"{pod.completion_index!r} is not an index below parallelism {group.nodes_per_slice}",
        )
    slice_index = group.first_slice[rj.name] + job_index
    contradiction = _contradiction(pod, jobset, group, slice_index, worker)
    if contradiction is not None:
        return contradiction
    domains = nodes.get(pod.node) if pod.node else None
    dns_name = f"{pod.hostname}.{pod.subdomain}" if pod.hostname and pod.subdomain else None
    return key, PodPlace(pod.name, pod.uid, slice_index, worker, dns_name, pod.ip, pod.node, domains)


def _jobset_of(pod: PodRecord, jobsets: Mapping[tuple[str, str], JobSetRecord]) -> JobSetRecord | ShapeProblem:
    """The JobSet the pod's annotation names, or the problem with that annotation or the pod's JobSet UID."""
    if pod.jobset is None:
        return _pod_problem(pod, f"annotation {JOBSET_NAME}", "missing: the pod mounts our volume but names no JobSet")
    jobset = jobsets.get((pod.namespace, pod.jobset))
    if jobset is None:
        return _pod_problem(
            pod, f"annotation {JOBSET_NAME}", f"JobSet {pod.jobset!r} is gone from namespace {pod.namespace!r}"
        )
    if pod.jobset_uid is not None and jobset.uid and pod.jobset_uid != jobset.uid:
        return _pod_problem(
            pod,
            f"label {JOBSET_UID}",
            f"{pod.jobset_uid!r} is not JobSet {jobset.name!r}'s UID {jobset.uid!r}: the pod is from an earlier JobSet of that name",
        )
    return jobset


def _replicated_job_of(pod: PodRecord, jobset: JobSetRecord) -> ReplicatedJobRecord | ShapeProblem:
    """The replicatedJob of ``jobset`` the pod's annotation names, or the problem with that annotation."""
    if pod.replicated_job is None:
        return _pod_problem(pod, f"annotation {REPLICATED_JOB}", "missing")
    rj = next((r for r in jobset.replicated_jobs if r.name == pod.replicated_job), None)
    if rj is None:
        return _pod_problem(
            pod,
            f"annotation {REPLICATED_JOB}",
            f"JobSet {jobset.name!r} has no replicatedJob {pod.replicated_job!r}",
        )
    if not rj.mounts:
        return _pod_problem(
            pod,
            f"annotation {REPLICATED_JOB}",
            f"replicatedJob {rj.name!r}'s pod template mounts no volume of our driver, but the pod does",
        )
    return rj


def _contradiction(
    pod: PodRecord, jobset: JobSetRecord, group: _Group, slice_index: int, worker: int
) -> ShapeProblem | None:
    """The first of the pod's volume attributes, then its subdomain, that contradicts what the API server's
    objects say of its place; None when none does."""
    slices = sum(group.replicas.values())
    expected = {
        "nodes": str(slices * group.nodes_per_slice),
        "slices": str(slices),
        "slice": str(slice_index),
        "worker": str(worker),
        "jobset": pod.subdomain or jobset.subdomain,
    }
    for attribute, value in expected.items():
        given = pod.attributes.get(attribute)
        if given is not None and given != value:
            return _pod_problem(
                pod, f"volume attribute {attribute}", f"{given!r} contradicts the API server's {value!r}"
            )
    if pod.subdomain is not None and pod.subdomain != jobset.subdomain:
        return _pod_problem(
            pod, "spec.subdomain", f"{pod.subdomain!r} is not JobSet {jobset.name!r}'s subdomain {jobset.subdomain!r}"
        )
    return None


def _attempt(pod: PodRecord) -> int:
    return int(pod.restart_attempt) if pod.restart_attempt and _INDEX.fullmatch(pod.restart_attempt) else -1


def compute_shapes(pods: Iterable[PodRecord], nodes: Iterable[NodeRecord], jobsets: Iterable[JobSetRecord]) -> Shapes:
    """Every job's shape from the API server's objects.

    Args:
      pods: the pods that mount our volume (``read_pod``); pods being deleted or finished are skipped.
      nodes: the nodes (``read_node``), for the failure domains.
      jobsets: the JobSets (``read_jobset``).

    Returns:
      ``Shapes``: a shape per job key of every JobSet whose spec is consistent, with its live pods that are;
      a problem per pod or JobSet left out. Two live pods at one (slice, worker) keep the newer restart attempt;
      at the same attempt both are left out.
    """
    problems: list[ShapeProblem] = []
    by_name = {(js.namespace, js.name): js for js in jobsets}
    groups = _unique_groups(by_name.values(), problems)
    domains = {node.name: FailureDomains(node.zone, node.nodepool, node.block) for node in nodes}
    placed = _placed_pods(pods, by_name, groups, domains, problems)
    shapes = {}
    for key, group in groups.items():
        slices = sum(group.replicas.values())
        shapes[key] = JobShape(
            job=key,
            jobset=group.jobset.name,
            jobset_uid=group.jobset.uid,
            replicated_jobs=tuple(rj.name for rj in group.members),
            nodes=slices * group.nodes_per_slice,
            slices=slices,
            nodes_per_slice=group.nodes_per_slice,
            pods=tuple(place for _, (_, place) in sorted(placed[key].items())),
        )
    return Shapes(types.MappingProxyType(shapes), tuple(problems), types.MappingProxyType(domains))


def _unique_groups(jobsets: Iterable[JobSetRecord], problems: list[ShapeProblem]) -> dict[JobRef, _Group]:
    """Every JobSet's groups by job key; a key already another JobSet's is a problem of the later JobSet,
    which gets no group for it."""
    groups: dict[JobRef, _Group] = {}
    for jobset in jobsets:
        for key, group in _groups(jobset, problems).items():
            if key in groups:
                problems.append(
                    _jobset_problem(
                        jobset, "volume attribute job", f"job {key.job!r} is also JobSet {groups[key].jobset.name!r}'s"
                    )
                )
                continue
            groups[key] = group
    return groups


def _placed_pods(
    pods: Iterable[PodRecord],
    jobsets: Mapping[tuple[str, str], JobSetRecord],
    groups: Mapping[JobRef, _Group],
    domains: Mapping[str, FailureDomains],
    problems: list[ShapeProblem],
) -> dict[JobRef, dict[tuple[int, int], tuple[PodRecord, PodPlace]]]:
    """Each job's live pods, by (slice, worker), as ``compute_shapes`` keeps them; a pod with a problem, and
    the pod kept at a place another live pod of the same restart attempt also claims, go to ``problems``."""
    placed: dict[JobRef, dict[tuple[int, int], tuple[PodRecord, PodPlace]]] = {key: {} for key in groups}
    clashes: set[tuple[JobRef, tuple[int, int]]] = set()
    for pod in pods:
        if not pod.live:
            continue
        found = _place(pod, jobsets, groups, domains)
        if isinstance(found, ShapeProblem):
            problems.append(found)
            continue
        key, place = found
        at = (place.slice, place.worker)
        other = placed[key].get(at)
        if other is None or _attempt(pod) > _attempt(other[0]):
            placed[key][at] = (pod, place)
            clashes.discard((key, at))
        elif _attempt(pod) == _attempt(other[0]):
            clashes.add((key, at))
    for key, at in sorted(clashes, key=lambda c: (c[0].namespace, c[0].job, c[1])):
        pod, _ = placed[key].pop(at)
        problems.append(
            _pod_problem(
                pod,
                f"annotations {JOB_INDEX}, {COMPLETION_INDEX}",
                f"another live pod of job {key.job!r} is at slice {at[0]}, worker {at[1]}",
            )
        )
    return placed
