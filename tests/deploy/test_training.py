"""A real training job in its container on the deployed product: a JobSet of the trainer image on two nodes, its
ramdisk published by the kubelet through the agent's container, trained through a preemption, an agent rollout
(``helm upgrade``) and a node loss; each time on the newest step, with the values of before. What ``kubectl`` shows
of it on the way: each restore's ``RestoreDone`` event (its source tiers and seconds) on the pods and the JobSet, and
the JobSet's ``mtc.dev/safe-step`` annotation advancing.

The steps are one job's life, in order: each test starts from where the one before left it."""

import re

import pytest

from tests.helpers.jobs import assert_same_state, compared_losses
from tests.helpers.kube.deploy_node import KUBELET_DIR
from tests.helpers.kube.deployment import RELEASE_NAMESPACE, TRAINING_NAMESPACE
from tests.helpers.kube.training_jobset import TrainingJobSet
from tests.helpers.polling import wait_until

DRIVER = "ramdisk.csi.mtc.dev"


@pytest.fixture(scope="module")
def job(deployment):
    job = TrainingJobSet(deployment, "llama", nodes=2)
    job.create()
    yield job
    deployment.sh(f"kubectl delete jobset {job.name} -n train --wait=true", check=False)


def assert_resumed(job, attempt, step, before):
    """Every pod of ``attempt`` restored ``step`` and went on with the losses and state of the killed run."""
    pods = job.running(attempt)
    assert [job.restored(p) for p in pods] == [[step]] * job.nodes, [job.events(p)[:3] for p in pods]
    after = job.losses(pods)
    assert min(after) == step + 1
    compared_losses(before, after)
    for rank in range(job.nodes):
        name = f"rank{rank}-step{step}.npz"
        assert_same_state(job.dumps / f"attempt-{attempt - 1}" / name, job.dumps / f"attempt-{attempt}" / name)


def restore_done(job, step: int, tiers: str) -> None:
    """Waits for the coordinator's ``RestoreDone`` event of ``step`` from ``tiers`` (a regular expression of the
    message's tier list) on one of the job's pods and on its JobSet, each with its seconds."""
    pattern = re.compile(rf"step {step} restored by {job.nodes} ranks in [0-9]+\.[0-9] s from {tiers}$")

    def found() -> set[str]:
        listed = job.cluster.kubectl_json(
            "get", "events", "-n", TRAINING_NAMESPACE, "--field-selector", "reason=RestoreDone"
        )
        return {
            e["involvedObject"]["kind"]
            for e in listed["items"]
            if pattern.match(e["message"]) and e["involvedObject"]["name"].startswith(job.name)
        }

    wait_until(
        lambda: found() >= {"Pod", "JobSet"}, 60, f"RestoreDone of step {step} from {tiers} on a pod and the JobSet"
    )


def safe_step_annotation(job) -> int | None:
    """The JobSet's ``mtc.dev/safe-step``, as ``kubectl get jobset -o jsonpath`` shows it, or None while absent."""
    done = job.cluster.sh(
        f"kubectl get jobset {job.name} -n {TRAINING_NAMESPACE} -o jsonpath='{{.metadata.annotations.mtc\\.dev/safe-step}}'"
    )
    return int(done.stdout) if done.stdout.strip() else None


def pause_when_replicated(job, pods):
    """Stops the trainers at a common newest commit and waits until the coordinator holds that step safe (its
    replicas made); returns (step, the stopped run's losses, the trainers' PIDs)."""
    before, pids = job.pause_at_common_commit(pods)
    status = job.wait_status(
        lambda s: s["safe_step"] is not None and s["safe_step"] == s["newest_complete_step"], "the last step safe"
    )
    return status["newest_complete_step"], before, pids


def test_the_agent_publishes_its_ramdisk_into_the_training_container(job, deployment):
    pods = job.running(0)
    assert {p.spec.nodeName for p in pods} == {n.name for n in deployment.nodes}
    job.wait_status(lambda s: (s["safe_step"] or -1) >= 3, "a safe step")
    for pod in pods:
        node = job.node_of(pod)
        # The training container's /local is the kubelet's publish target, a bind of the job's tmpfs, which the agent
        # mounted from its container below the kubelet directory: the same files on both sides.
        assert job.committed(pod), f"{pod.metadata.name} committed nothing"
        mounts = node.mounts()
        tmpfs = {
            device for point, (_, device) in mounts.items() if point.startswith(f"{KUBELET_DIR}/plugins/{DRIVER}/")
        }
        volumes = f"{KUBELET_DIR}/pods/{pod.metadata.uid}/volumes/kubernetes.io~csi/"
        published = {device for point, (_, device) in mounts.items() if point.startswith(volumes)}
        assert tmpfs and published and published <= tmpfs, mounts


def test_preempted_pods_resume_the_newest_step(job):
    step, before, trainers = pause_when_replicated(job, job.running(0))
    job.kill(trainers)
    job.cluster.sh("kubectl delete pods -n train -l jobset.sigs.k8s.io/jobset-name=llama --wait=false")
    assert_resumed(job, 1, step, before)
    restore_done(job, step, f"local x{job.nodes}")


def test_an_agent_rollout_leaves_the_job_training_on_its_ramdisk(job, deployment):
    pods = job.running(1)
    wait_until(lambda: safe_step_annotation(job) is not None, 30, "the JobSet's mtc.dev/safe-step")
    annotated = safe_step_annotation(job)
    agents_before = {p["metadata"]["uid"] for p in agent_pods(deployment)}
    mounts_before = {n.name: ramdisk_mounts(n) for n in deployment.nodes}
    deployment.sh(
        f"helm upgrade mtc charts/mtc --namespace {RELEASE_NAMESPACE} --reuse-values "
        "--set-string node.podAnnotations.rollout=1 --wait",
        timeout=600,
    )
    agents_after = agent_pods(deployment)
    assert not agents_before & {p["metadata"]["uid"] for p in agents_after}, "the DaemonSet did not roll"
    # The trainers never stopped, and their ramdisks are the same mounts: the agents' restarts left them in place.
    now = job.pods(1)
    assert [p.metadata.uid for p in now] == [p.metadata.uid for p in pods]
    assert all(p.status.containerStatuses[0].restartCount == 0 and p.status.phase == "Running" for p in now)
    for node in deployment.nodes:
        assert mounts_before[node.name] and ramdisk_mounts(node) == mounts_before[node.name], node.name
    trained = max(job.losses(pods))
    wait_until(lambda: max(job.losses(pods)) > trained + 3, 120, "training on after the rollout")
    newest = job.status()["newest_complete_step"]
    safe = job.wait_status(
        lambda s: s["safe_step"] is not None and s["safe_step"] > newest, "a step made safe after the rollout"
    )["safe_step"]
    # Patched on change at most every 5 s (jobset_annotations.py).
    wait_until(lambda: (safe_step_annotation(job) or -1) >= safe, 30, f"mtc.dev/safe-step at {safe} or later")
    assert safe > annotated, (annotated, safe)


def test_a_lost_node_is_restored_from_its_peer_on_a_fresh_node(job, deployment):
    pods = job.running(1)
    step, before, trainers = pause_when_replicated(job, pods)
    lost = job.node_of(pods[1])
    survivor = job.node_of(pods[0])
    deployment.lose_node(lost)  # with the trainer of rank 1; rank 0's fails next, as JAX's would on losing its peer
    job.kill(trainers[:1])
    fresh = deployment.add_node()
    assert_resumed(job, 2, step, before)
    placed = {p.spec.nodeName for p in job.pods(2)}
    assert placed == {survivor.name, fresh.name}
    status = job.status()
    assert status["restore"]["step"] == step, status["restore"]
    assert any(source.endswith(f":{survivor.name}") for source in status["restore"]["sources"].values()), status
    restore_done(job, step, r"(local x1, )?peer_(close|distant) x[12]")


def ramdisk_mounts(node) -> dict[str, tuple[str, str]]:
    """The node's ramdisks and the training pods' publish targets (binds of them), with their mount IDs."""
    return {
        point: mount
        for point, mount in node.mounts().items()
        if point.startswith(f"{KUBELET_DIR}/plugins/{DRIVER}/") or "/volumes/kubernetes.io~csi/" in point
    }


def agent_pods(deployment) -> list[dict]:
    listed = deployment.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=node")
    return [p for p in listed["items"] if p["metadata"].get("deletionTimestamp") is None]
