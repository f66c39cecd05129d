"""A user's training job on the deployment suite's cluster: a JobSet of the trainer image (``examples/train.py``:
JAX and Orbax's ``ReplicatorCheckpointManager`` on CPU), one pod per node, its ramdisk the driver-only inline volume.

Everything is read as an operator would, from outside the pods: the trainer's events from the pod's container log
(its stdout, JSON lines, as the kubelet writes it), the steps it committed from its volume on the node, its state
dumps from a hostPath directory, and the coordinator's status through ``mtc status`` run in an agent's container.
"""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time

import psutil
from lightkube import codecs
from lightkube.resources.core_v1 import Event, Pod

from replicator.coordinator.kube.kube_watch import JobSet  # registers the kind with lightkube's codecs
from tests.helpers.jobs import UNTIL_KILLED_STEPS
from tests.helpers.kube.deploy_node import KUBELET_DIR, DeployNode
from tests.helpers.kube.deployment import REGISTRY, RELEASE_NAMESPACE, TRAINING_NAMESPACE, VERSION, Deployment

ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
WAIT_SECONDS = 300.0


class TrainingJobSet:
    """JobSet ``name`` of ``nodes`` pods (replicatedJob ``slice``: the job is ``<name>-slice``, data parallelism 1).

    Each attempt dumps its state to ``<dumps>/attempt-<n>`` (``--dump-dir``), a hostPath every node sees.
    """

    def __init__(self, cluster: Deployment, name: str, nodes: int):
        self.cluster = cluster
        self.name = name
        self.job = f"{name}-slice"
        self.nodes = nodes
        self.dumps = cluster.plane.workdir / "dumps"
        self._operator_token: str | None = None

    def manifest(self) -> dict:
        args = [
            "--local-dir=/local",
            f"--run-name={self.job}",
            "--num-slices=1",
            f"--nodes={self.nodes}",
            f"--steps={UNTIL_KILLED_STEPS}",
            "--step-sleep=0.3",
            "--save-interval-steps=3",
            "--backup-interval-steps=6",
            "--dump-dir=/dumps/attempt-$(ATTEMPT)",
        ]
        pod = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": self.name}},
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
            "containers": [
                {
                    "name": "trainer",
                    "image": f"{REGISTRY}/mtc-trainer:{VERSION}",
                    "args": args,
                    "env": [
                        {
                            "name": "ATTEMPT",
                            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{ATTEMPT}']"}},
                        }
                    ],
                    "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
                    "volumeMounts": [
                        {"name": "mtc-local", "mountPath": "/local"},
                        {"name": "dumps", "mountPath": "/dumps"},
                    ],
                }
            ],
            "volumes": [
                {"name": "mtc-local", "csi": {"driver": "ramdisk.csi.mtc.dev"}},
                {"name": "dumps", "hostPath": {"path": str(self.dumps), "type": "DirectoryOrCreate"}},
            ],
        }
        return {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": self.name, "namespace": TRAINING_NAMESPACE},
            "spec": {
                "failurePolicy": {"maxRestarts": 10},
                "replicatedJobs": [
                    {
                        "name": "slice",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "parallelism": self.nodes,
                                "completions": self.nodes,
                                "completionMode": "Indexed",
                                "backoffLimit": 0,
                                "template": {"spec": pod},
                            }
                        },
                    }
                ],
            },
        }

    def create(self) -> None:
        jobset = codecs.from_dict(self.manifest())
        assert isinstance(jobset, JobSet)
        self.cluster.client().create(jobset)

    def pods(self, attempt: int | None = None) -> list[Pod]:
        """The job's pods (of ``attempt`` if given), by completion index."""
        pods = self.cluster.client().list(
            Pod, namespace=TRAINING_NAMESPACE, labels={"jobset.sigs.k8s.io/jobset-name": self.name}
        )
        found = [p for p in pods if attempt is None or int(p.metadata.annotations.get(ATTEMPT, "0")) == attempt]
        return sorted(found, key=lambda p: int(p.metadata.annotations["batch.kubernetes.io/job-completion-index"]))

    def running(self, attempt: int, timeout: float = WAIT_SECONDS) -> list[Pod]:
        """The ``nodes`` pods of ``attempt`` once each runs, has logged its restore, and rank 0 a trained step."""
        deadline = time.monotonic() + timeout
        while True:
            pods = [
                p for p in self.pods(attempt) if p.status.phase == "Running" and p.metadata.deletionTimestamp is None
            ]
            # Every rank logs its restore (of no step, at first); rank 0 alone logs the losses.
            if len(pods) == self.nodes and all(self.restored(p) for p in pods) and self.losses(pods):
                return pods
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"attempt {attempt} of {self.name} not training after {timeout} s: {self._phases()}; "
                    f"why: {self._why_waiting()}; this machine's memory available: "
                    f"{psutil.virtual_memory().available} bytes"
                )
            time.sleep(1)

    def _phases(self) -> list[tuple]:
        return [
            (p.metadata.name, p.spec.nodeName, p.status.phase, p.metadata.annotations.get(ATTEMPT)) for p in self.pods()
        ]

    def _why_waiting(self) -> list[str]:
        """What the kubelet and the scheduler said about each pod not running: its conditions, its containers'
        waiting reasons and its events, so a pod stuck in Pending names its cause in the failure."""
        said = []
        for pod in self.pods():
            if pod.status.phase == "Running":
                continue
            for condition in pod.status.conditions or []:
                if condition.status != "True":
                    said.append(f"{pod.metadata.name} {condition.type}: {condition.reason} {condition.message}")
            for container in (pod.status.initContainerStatuses or []) + (pod.status.containerStatuses or []):
                if waiting := container.state and container.state.waiting:
                    said.append(f"{pod.metadata.name} {container.name} waiting: {waiting.reason} {waiting.message}")
            events = self.cluster.client().list(
                Event, namespace=TRAINING_NAMESPACE, fields={"involvedObject.name": pod.metadata.name}
            )
            said += [f"{pod.metadata.name} event {e.reason}: {e.message} (x{e.count})" for e in events]
        return said

    def node_of(self, pod: Pod) -> DeployNode:
        return next(n for n in self.cluster.nodes if n.name == pod.spec.nodeName)

    def events(self, pod: Pod) -> list[dict]:
        """The trainer's events (its stdout's JSON lines) from the kubelet's log of the pod's container."""
        node = self.node_of(pod)
        directory = node.dir / "pod-logs" / f"{TRAINING_NAMESPACE}_{pod.metadata.name}_{pod.metadata.uid}" / "trainer"
        events = []
        for log in sorted(directory.glob("*.log")) if directory.is_dir() else []:
            for line in log.read_text(errors="replace").splitlines():
                _, stream, tag, text = (line.split(" ", 3) + ["", "", ""])[:4]
                if stream == "stdout" and tag == "F" and text.startswith("{"):
                    events.append(json.loads(text))
        return events

    def losses(self, pods: list[Pod]) -> dict[int, float]:
        return {e["step"]: e["loss"] for pod in pods for e in self.events(pod) if e["event"] == "step"}

    def restored(self, pod: Pod) -> list[int]:
        return [e["step"] for e in self.events(pod) if e["event"] == "restored"]

    def volume(self, pod: Pod):
        """The pod's ramdisk as its node sees it (the publish target)."""
        target = f"{KUBELET_DIR}/pods/{pod.metadata.uid}/volumes/kubernetes.io~csi/mtc-local/mount"
        return self.node_of(pod).path(target)

    def committed(self, pod: Pod) -> set[int]:
        volume = self.volume(pod)
        return {int(n) for n in os.listdir(volume) if n.isdigit()} if volume.is_dir() else set()

    def trainer_pid(self, pod: Pod) -> int:
        """The trainer's PID in this machine's PID namespace, from the node's containerd."""
        container = pod.status.containerStatuses[0].containerID.removeprefix("containerd://")
        for line in self.node_of(pod).ctr("tasks", "ls").splitlines()[1:]:
            task, pid, *_ = line.split()
            if task == container:
                return int(pid)
        raise LookupError(f"no task {container} on {pod.spec.nodeName}")

    def pause_at_common_commit(self, pods: list[Pod], timeout: float = 120.0) -> tuple[dict[int, float], list[int]]:
        """SIGSTOPs the trainers of ``pods`` at a moment when every pod's newest commit is the same step and a loss
        after it is logged, so that a restored run has the stopped run's losses to compare with. Returns the
        stopped run's losses and the trainers' PIDs (to SIGKILL: ``kill``)."""
        pids = [self.trainer_pid(p) for p in pods]
        deadline = time.monotonic() + timeout
        while True:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            held, logged = [self.committed(p) for p in pods], self.losses(pods)
            newest = max(set.intersection(*held), default=None)
            if newest is not None and all(max(h) == newest for h in held) and max(logged, default=-1) > newest:
                return logged, pids
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            assert time.monotonic() < deadline, f"no common newest commit in {timeout} s: {held}"
            time.sleep(0.2)

    @staticmethod
    def kill(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def operator_token(self) -> str:
        """A token of an operator who may read the training namespace, as operator identity asks: its ``default``
        ServiceAccount, bound to the built-in ``view`` role (which takes ``mtc-checkpoint-viewer`` by aggregation);
        made once."""
        if self._operator_token is None:
            self.cluster.sh(
                f"kubectl -n {TRAINING_NAMESPACE} create rolebinding mtc-e2e-view --clusterrole view "
                f"--serviceaccount {TRAINING_NAMESPACE}:default --dry-run=client -o yaml | kubectl apply -f -"
            )
            token = self.cluster.sh(f"kubectl -n {TRAINING_NAMESPACE} create token default --duration 4h").stdout
            self._operator_token = token.strip()
        return self._operator_token

    def status(self) -> dict:
        """The coordinator's status of the job: ``mtc status --json`` in an agent's container, through the
        coordinator's Service name (cluster DNS, kube-proxy) and its CA, with ``operator_token`` (written to the
        container's /tmp from stdin: the agent itself holds no Kubernetes token)."""
        daemonset = self.cluster.kubectl_json("get", "daemonset", "mtc-node", "-n", RELEASE_NAMESPACE)
        args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
        url = args[args.index("--coordinator") + 1]
        status = (
            f"mtc status --coordinator {url} --ca /etc/mtc/tls/ca.crt --json --job {TRAINING_NAMESPACE}/{self.job} "
            "--token-file /tmp/operator-token"
        )
        done = self.cluster.sh(
            f"kubectl exec -i -n {RELEASE_NAMESPACE} ds/mtc-node -c mtc-node -- "
            f"sh -c {shlex.quote(f'cat > /tmp/operator-token && exec {status}')} <<< {shlex.quote(self.operator_token())}"
        )
        return json.loads(done.stdout)["jobs"][0]

    def wait_status(self, condition, what: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = self.status()
                if condition(status):
                    return status
            except (AssertionError, IndexError, subprocess.SubprocessError):
                status = None
            assert time.monotonic() < deadline, f"{what}: not after {timeout} s (status {status})"
            time.sleep(2)
