"""Kubernetes objects as the API server returns them (plain dicts), for the pure tests of the coordinator's shapes
(``kube_shape``) and overlay (``kube_overlay``): the README's example JobSet, its pods and nodes."""

from collections.abc import Iterable
from typing import Any

from replicator.coordinator.kube.kube_shape import (
    JobShape,
    PodPlace,
    Shapes,
    ShapeSettings,
    compute_shapes,
    read_jobset,
    read_node,
    read_pod,
)

NS = "default"
DRIVER = "ramdisk.csi.mtc.dev"


def replicated(name: str, replicas: int, parallelism: int, pod_spec: dict) -> dict:
    """A replicatedJob of ``replicas`` Indexed Jobs (slices) of ``parallelism`` pods each, none retried."""
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            "spec": {
                "parallelism": parallelism,
                "completions": parallelism,
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "template": {"spec": pod_spec},
            }
        },
    }


def replicated_job(name: str, replicas: int, parallelism: int, *, mounts: bool = True, job: str | None = None) -> dict:
    volume = {"name": "mtc-local", "csi": {"driver": DRIVER, "volumeAttributes": {"job": job} if job else {}}}
    pod_spec = {"containers": [{"name": "c", "image": "x"}], "volumes": [volume] if mounts else []}
    return replicated(name, replicas, parallelism, pod_spec)


def jobset(name: str, *replicated: dict, uid: str = "uid-1") -> dict:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NS, "uid": uid},
        "spec": {"replicatedJobs": list(replicated)},
    }


def pod(
    js: str,
    rj: str,
    job_index: int,
    worker: int,
    *,
    node: str | None = None,
    mounts: bool = True,
    attributes: dict | None = None,
    attempt: int = 0,
    uid: str = "uid-1",
    **overrides,
) -> dict:
    hostname = f"{js}-{rj}-{job_index}-{worker}"
    obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{hostname}-abcde",
            "namespace": NS,
            "uid": f"pod-{hostname}",
            "labels": {"jobset.sigs.k8s.io/jobset-uid": uid},
            "annotations": {
                "jobset.sigs.k8s.io/jobset-name": js,
                "jobset.sigs.k8s.io/replicatedjob-name": rj,
                "jobset.sigs.k8s.io/job-index": str(job_index),
                "batch.kubernetes.io/job-completion-index": str(worker),
                "jobset.sigs.k8s.io/restart-attempt": str(attempt),
            },
        },
        "spec": {
            "hostname": hostname,
            "subdomain": js,
            "nodeName": node,
            "containers": [{"name": "c"}],
            "volumes": [{"name": "v", "csi": {"driver": DRIVER, "volumeAttributes": attributes or {}}}]
            if mounts
            else [],
        },
        "status": {"phase": "Running", "podIP": f"10.1.{job_index}.{worker}"},
    }
    for dotted, value in overrides.items():
        *path, last = dotted.split("__")
        target = obj
        for key in path:
            target = target[key]
        if value is None:
            target.pop(last, None)
        else:
            target[last] = value
    return obj


def node(
    name: str, zone: str, pool: str, block: str | None = None, block_label: str = "cloud.google.com/gce-topology-block"
) -> dict:
    labels = {"topology.kubernetes.io/zone": zone, "cloud.google.com/gke-nodepool": pool}
    if block:
        labels[block_label] = block
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def example_pods(js: str = "llama-train", rj: str = "slice", **kwargs) -> list[dict]:
    return [pod(js, rj, s, w, node=f"n{s}{w}", **kwargs) for s in range(2) for w in range(2)]


EXAMPLE_NODES = [node(f"n{s}{w}", f"zone-{s}", f"pool-{s}", f"block-{w}") for s in range(2) for w in range(2)]


def shapes_of(
    pods: Iterable[Any], nodes: Iterable[Any], jobsets: Iterable[Any], settings: ShapeSettings = ShapeSettings()
) -> Shapes:
    """``compute_shapes`` over objects as the API server returns them (dicts or lightkube models), read as the
    coordinator's watcher reads them."""
    records = [read_pod(p, settings) for p in pods]
    return compute_shapes(
        [r for r in records if r is not None],
        [read_node(n, settings) for n in nodes],
        [read_jobset(js, settings) for js in jobsets],
    )


def pod_at(shape: JobShape, slice_index: int, worker: int) -> PodPlace | None:
    """The shape's pod at (slice, worker), or None."""
    return next((p for p in shape.pods if (p.slice, p.worker) == (slice_index, worker)), None)
