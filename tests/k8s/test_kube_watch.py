"""The coordinator's view of job shapes (replicator/coordinator/kube/kube_watch.py) against a real control plane: the
README's example JobSet, a JobSet with a driver beside its workers, and the API server stopped and started again.

Pods are created by the real JobSet and Job controllers and bound by the real scheduler to Node objects with no
kubelet (they stay Pending, with no pod IP)."""

import asyncio
import contextlib
from pathlib import Path

import pytest
import yaml
from lightkube import ApiError, AsyncClient, KubeConfig, codecs
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.core_v1 import NamespaceSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding

from replicator.coordinator.kube.kube_shape import (
    COMPLETION_INDEX,
    JOB_INDEX,
    JOBSET_NAME,
    REPLICATED_JOB,
    FailureDomains,
    JobShape,
    ShapeSettings,
)
from replicator.coordinator.kube.kube_watch import JobSet, ShapeWatcher, WatchSettings
from replicator.wire.messages import JobRef
from tests.helpers import REPO
from tests.helpers.kube import ControlPlane, register_node
from tests.helpers.kube.workloads import NO_PULL_IMAGE, example_jobset, jobset
from tests.helpers.kube_objects import pod_at
from tests.helpers.kube_objects import replicated as replicated_of

NAMESPACE = "shapes"
REFUSALS = "refusals"
COORDINATOR_NAMESPACE = "mtc-system"
WAIT_SECONDS = 60.0
OUTAGE_SECONDS = 5.0
BLOCK_LABEL = "example.com/rack"


def driver_and_workers_jobset(name: str) -> dict:
    """A JobSet with a driver replicatedJob (no volume of ours) and 2 slices x 2 workers that mount it."""

    def replicated(rj: str, replicas: int, parallelism: int, volume: bool) -> dict:
        pod_spec = {"restartPolicy": "Never", "containers": [{"name": "c", "image": NO_PULL_IMAGE}]}
        if volume:
            pod_spec["volumes"] = [{"name": "mtc-local", "csi": {"driver": "ramdisk.csi.mtc.dev"}}]
        return replicated_of(rj, replicas, parallelism, pod_spec)

    return jobset(name, replicated("driver", 1, 1, False), replicated("workers", 2, 2, True))


EXAMPLE = JobRef(NAMESPACE, "llama-train-slice")
OUTAGE_EXAMPLE = JobRef("default", "llama-train-slice")


def _bound(shapes, job: JobRef) -> bool:
    """Every pod of ``job`` is in its shape and bound to a node."""
    shape = shapes.jobs.get(job)
    return shape is not None and len(shape.pods) == shape.nodes and all(p.node for p in shape.pods)


def placement(shape: JobShape) -> list[tuple[int, int, str | None]]:
    return [(p.slice, p.worker, p.dns_name) for p in shape.pods]


@contextlib.asynccontextmanager
async def running_watcher(kubeconfig: Path, namespace: str):
    """A ``ShapeWatcher`` on ``namespace`` with its own client and a short backoff bound, running in the test's
    loop until the block ends."""
    settings = WatchSettings(
        namespace=namespace,
        backoff_initial_seconds=0.2,
        backoff_max_seconds=1.0,
        shape=ShapeSettings(block_label=BLOCK_LABEL),
    )
    client = AsyncClient(KubeConfig.from_file(kubeconfig), field_manager="mtc-coordinator")
    watcher = ShapeWatcher(client, settings)
    task = asyncio.create_task(watcher.run())
    try:
        yield watcher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


def coordinator_kubeconfig(plane: ControlPlane, path: Path) -> Path:
    """A kubeconfig with the coordinator's own identity: ``manifests/coordinator-rbac.yaml`` applied (in
    ``mtc-system``) and a token of its ServiceAccount, so the watcher runs with exactly the rights the manifests
    grant."""
    client = plane.client()
    client.create(Namespace(metadata=ObjectMeta(name=COORDINATOR_NAMESPACE), spec=NamespaceSpec()))
    for obj in codecs.load_all_yaml((REPO / "manifests" / "coordinator-rbac.yaml").read_text()):
        client.create(obj)
    request = ServiceAccount.Token(
        metadata=ObjectMeta(name="mtc-coordinator", namespace=COORDINATOR_NAMESPACE),
        spec=TokenRequestSpec(audiences=[], expirationSeconds=3600),
    )
    token = client.create(request, "mtc-coordinator", namespace=COORDINATOR_NAMESPACE).status.token
    config = yaml.safe_load(plane.kubeconfig.read_text())
    config["users"] = [{"name": "mtc-coordinator", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "mtc-coordinator"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
async def watcher(control_plane, kube, tmp_path):
    """A watcher of the ``shapes`` namespace of the session's control plane, with the coordinator's own identity;
    the namespaces are deleted after."""
    await kube.create(Namespace(metadata=ObjectMeta(name=NAMESPACE), spec=NamespaceSpec()))
    await eventually(
        lambda: _exists(kube, ServiceAccount, "default", NAMESPACE), "the namespace's default ServiceAccount"
    )
    try:
        kubeconfig = await asyncio.to_thread(coordinator_kubeconfig, control_plane, tmp_path / "coordinator.kubeconfig")
        async with running_watcher(kubeconfig, NAMESPACE) as shapes:
            yield shapes
    finally:
        await kube.delete(Namespace, NAMESPACE)
        with contextlib.suppress(ApiError):
            await kube.delete(Namespace, COORDINATOR_NAMESPACE)
            for kind in (ClusterRole, ClusterRoleBinding):
                await kube.delete(kind, "mtc-coordinator")


def register_nodes(plane: ControlPlane, prefix: str, count: int) -> list[str]:
    """Nodes with no kubelet, each with a zone and node pool per pair and a rack of its own."""
    client = plane.client()
    names = [f"{prefix}-{i}" for i in range(count)]
    for i, name in enumerate(names):
        register_node(
            client,
            name,
            labels={
                "topology.kubernetes.io/zone": f"zone-{i // 2}",
                "cloud.google.com/gke-nodepool": f"pool-{i // 2}",
                BLOCK_LABEL: f"rack-{i}",
            },
        )
    return names


async def _exists(kube: AsyncClient, kind, name: str, namespace: str) -> bool:
    try:
        await kube.get(kind, name, namespace=namespace)
        return True
    except ApiError:
        return False


async def eventually(condition, what: str) -> None:
    """Polls ``condition`` (sync, or async returning an awaitable) in the test's loop until it holds."""
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            while True:
                result = condition()
                if asyncio.iscoroutine(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{what}: not reached within {WAIT_SECONDS} s") from None


async def test_watcher_shapes_the_example_jobset_and_counts_only_the_workers_beside_a_driver(
    control_plane, kube, watcher
):
    register_nodes(control_plane, "shape-node", 4)

    # The README's example: 2 slices x 2 nodes, pods reachable as <hostname>.<JobSet name>.
    await kube.create(codecs.from_dict(example_jobset()), namespace=NAMESPACE)
    shapes = await watcher.wait_for(lambda s: _bound(s, EXAMPLE), WAIT_SECONDS)
    shape = shapes.jobs[EXAMPLE]
    assert (shape.jobset, shape.nodes, shape.slices, shape.nodes_per_slice) == ("llama-train", 4, 2, 2)
    assert placement(shape) == [(j, i, f"llama-train-slice-{j}-{i}.llama-train") for j in range(2) for i in range(2)]
    assert all(p.name.startswith(f"llama-train-slice-{p.slice}-{p.worker}-") for p in shape.pods)
    assert {p.ip for p in shape.pods} == {None}  # no kubelet: no pod IP
    assert len({p.node for p in shape.pods}) == 4  # the example's anti-affinity: one pod per node
    for place in shape.pods:  # the scheduler may pick other tests' nodes too: each node's own labels
        labels = (await kube.get(Node, place.node)).metadata.labels
        assert place.domains == FailureDomains(
            zone=labels.get("topology.kubernetes.io/zone"),
            nodepool=labels.get("cloud.google.com/gke-nodepool"),
            block=labels.get(BLOCK_LABEL),
        )
    assert shapes.problems == ()

    # A driver (no volume) beside the workers: only the workers make up the job.
    await kube.create(codecs.from_dict(driver_and_workers_jobset("train")), namespace=NAMESPACE)
    workers = JobRef(NAMESPACE, "train-workers")
    shapes = await watcher.wait_for(lambda s: workers in s.jobs and len(s.jobs[workers].pods) == 4, WAIT_SECONDS)
    shape = shapes.jobs[workers]
    assert (shape.nodes, shape.slices, shape.replicated_jobs) == (4, 2, ("workers",))
    assert placement(shape) == [(j, i, f"train-workers-{j}-{i}.train") for j in range(2) for i in range(2)]
    assert sorted(k.job for k in shapes.jobs) == ["llama-train-slice", "train-workers"]  # no job for the driver
    assert shapes.problems == ()


async def test_last_shapes_stand_through_an_api_server_outage_and_updates_resume(own_control_plane):
    plane = own_control_plane
    nodes = register_nodes(plane, "outage-node", 4)
    client = AsyncClient(KubeConfig.from_file(plane.kubeconfig), field_manager="mtc-tests")
    try:
        async with running_watcher(plane.kubeconfig, "default") as watcher:
            await client.create(codecs.from_dict(example_jobset()), namespace="default")
            shapes = await watcher.wait_for(lambda s: _bound(s, OUTAGE_EXAMPLE), WAIT_SECONDS)
            for place in shapes.jobs[OUTAGE_EXAMPLE].pods:  # only this test's nodes here
                i = nodes.index(place.node)
                assert place.domains == FailureDomains(f"zone-{i // 2}", f"pool-{i // 2}", f"rack-{i}")

            # The API server goes away: the last shapes stand, whatever the watches go through.
            before, version = watcher.shapes, watcher.version
            await asyncio.to_thread(plane.stop_component, "kube-apiserver")
            try:
                await eventually(lambda: not any(watcher.connected.values()), "every watch has seen the outage")
                await asyncio.sleep(OUTAGE_SECONDS)
                assert watcher.shapes == before and watcher.version == version
                assert "ConnectError" in watcher.last_error
            finally:
                await asyncio.to_thread(plane.start_component, "kube-apiserver")
            assert watcher.shapes == before

            # Updates resume: a node's zone changes, and the shape says so.
            moved = shapes.jobs[OUTAGE_EXAMPLE].pods[0]
            await client.patch(
                Node, moved.node, {"metadata": {"labels": {"topology.kubernetes.io/zone": "zone-moved"}}}
            )
            shapes = await watcher.wait_for(
                lambda s: pod_at(s.jobs[OUTAGE_EXAMPLE], moved.slice, moved.worker).domains.zone == "zone-moved",
                WAIT_SECONDS,
            )
            # And a JobSet deleted after the outage takes its shape with it (the JobSet watch resumes once its CRD
            # is served again: 503 and 429 answers first).
            await client.delete(JobSet, "llama-train", namespace="default")
            shapes = await watcher.wait_for(lambda s: OUTAGE_EXAMPLE not in s.jobs, WAIT_SECONDS)
            assert shapes.jobs == {}
            await eventually(lambda: all(watcher.connected.values()), "every watch connected again")
    finally:
        await client.close()


async def test_pods_naming_a_missing_jobset_or_contradicting_theirs_are_refused_by_pod_and_field(control_plane, kube):
    # A namespace of its own: the ``watcher`` fixture's is still being deleted (its pods are bound to nodes without
    # a kubelet, so their deletion is never confirmed).
    await kube.create(Namespace(metadata=ObjectMeta(name=REFUSALS), spec=NamespaceSpec()))
    await eventually(
        lambda: _exists(kube, ServiceAccount, "default", REFUSALS), "the namespace's default ServiceAccount"
    )
    async with running_watcher(control_plane.kubeconfig, REFUSALS) as watcher:
        await _refusals(kube, watcher)


async def _refusals(kube: AsyncClient, watcher: ShapeWatcher) -> None:
    # A JobSet whose volume says 3 nodes where the API server counts 4: each of its pods is refused.
    wrong = example_jobset()
    wrong["metadata"]["name"] = "wrong"
    for replicated in wrong["spec"]["replicatedJobs"]:
        replicated["template"]["spec"]["template"]["spec"]["volumes"][0]["csi"]["volumeAttributes"]["nodes"] = "3"
    await kube.create(codecs.from_dict(wrong), namespace=REFUSALS)
    # A pod that claims a JobSet no one made (a hand-written pod, or one whose JobSet is gone).
    ghost = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "ghost-slice-0-0-x",
            "labels": {JOBSET_NAME: "ghost"},
            "annotations": {JOBSET_NAME: "ghost", REPLICATED_JOB: "slice", JOB_INDEX: "0", COMPLETION_INDEX: "0"},
        },
        "spec": {
            "containers": [{"name": "c", "image": NO_PULL_IMAGE}],
            "volumes": [{"name": "v", "csi": {"driver": "ramdisk.csi.mtc.dev"}}],
        },
    }
    await kube.create(codecs.from_dict(ghost), namespace=REFUSALS)

    def refused(shapes) -> dict[str, tuple[str, str]]:
        return {p.name: (p.field, p.reason) for p in shapes.problems if p.kind == "Pod" and p.namespace == REFUSALS}

    shapes = await watcher.wait_for(lambda s: len(refused(s)) == 5, WAIT_SECONDS)
    problems = refused(shapes)
    assert problems.pop("ghost-slice-0-0-x") == (
        f"annotation {JOBSET_NAME}",
        "JobSet 'ghost' is gone from namespace 'refusals'",
    )
    assert sorted(name.rsplit("-", 1)[0] for name in problems) == [
        f"wrong-slice-{j}-{i}" for j in range(2) for i in range(2)
    ]
    assert {field for field, _ in problems.values()} == {"volume attribute nodes"}
    assert all("'3' contradicts the API server's '4'" == reason for _, reason in problems.values())
    assert shapes.jobs[JobRef(REFUSALS, "wrong-slice")].pods == ()  # refused pods get no place, so no rank
