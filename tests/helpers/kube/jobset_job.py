"""A training job whose pods the real JobSet controller creates, run on stand-in nodes (``JobSetJob``).

The pods are the API server's: the JobSet controller makes the Jobs, kube-controller-manager the pods, the scheduler
binds them to Node objects that have no kubelet (``register_node``). For each bound pod the stand-in does a kubelet's
part on the node agent of that Node (``LocalCluster(kubeconfig=...)``: node ``node-<i>``):
- writes the pod's status (Running, its pod IP: the node's loopback host, as for ``hostNetwork``);
- calls ``NodePublishVolume`` with the ``volume_context`` a kubelet builds (pod name, namespace, UID, service account,
  ephemeral) plus the pod's own ``volumeAttributes``;
- runs the trainer (``examples/train.py``) in the target path.
Deleting the pods is a kubelet's part too: the trainers are killed, the volumes unpublished, and the pods' deletion
confirmed (grace period 0). A deleted, unfinished pod fails its Job (``backoffLimit: 0``), and the JobSet restarts
every Job: the next ``create_pods`` waits for the pods of that newer restart attempt.

Why stand-ins: a real kubelet here runs only images it can import (busybox); the trainer needs the project's Python.
``tests/k8s/test_kubelet_csi.py`` covers the real kubelet's side of the volume.
"""

import dataclasses
import os
import time

from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Pod

from csi_driver import kubelet
from examples.local_cluster import LocalJob
from examples.local_cluster import Pod as TrainingPod
from replicator.coordinator.kube.kube_shape import COMPLETION_INDEX, JOB_INDEX, JOBSET_NAME, RESTART_ATTEMPT

POD_WAIT_SECONDS = 120.0


def _attempt(pod: Pod) -> int:
    return int(pod.metadata.annotations.get(RESTART_ATTEMPT, "0"))


@dataclasses.dataclass
class JobSetJob(LocalJob):
    """``LocalJob`` over the pods of JobSet ``name`` in ``namespace`` (see the module docstring).

    Attributes:
      client: the API server's client.
      namespace: the JobSet's namespace.
      driver: our CSI driver's name (the volume whose attributes are passed on).
      attempt: the JobSet restart attempt of the current pods (-1 before the first).
      api_pods: the current pods as the API server had them when they were published, in (slice, worker) order.
    """

    client: Client | None = None
    namespace: str = "default"
    driver: str = "ramdisk.csi.mtc.dev"
    attempt: int = -1
    api_pods: list[Pod] = dataclasses.field(default_factory=list)

    def _bound_pods(self) -> list[Pod] | None:
        """The JobSet's live pods of a newer restart attempt, once there is one per agent and all are bound."""
        pods = [
            p
            for p in self.client.list(Pod, namespace=self.namespace, labels={JOBSET_NAME: self.name})
            if p.metadata.deletionTimestamp is None and _attempt(p) > self.attempt
        ]
        if len(pods) != len(self.agents) or not all(p.spec.nodeName for p in pods):
            return None
        return sorted(
            pods, key=lambda p: (int(p.metadata.annotations[JOB_INDEX]), int(p.metadata.annotations[COMPLETION_INDEX]))
        )

    def create_pods(self) -> list[TrainingPod]:
        """Waits for the JobSet's next pods, runs each on its node's agent as a kubelet would (not the trainers)."""
        deadline = time.monotonic() + POD_WAIT_SECONDS
        while (pods := self._bound_pods()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"JobSet {self.namespace}/{self.name}: no {len(self.agents)} bound pods of a restart "
                    f"attempt after {self.attempt} within {POD_WAIT_SECONDS} s"
                )
            time.sleep(0.2)
        agents = {agent.node_id: agent for agent in self.agents}
        self.incarnations += 1
        self.attempt, self.api_pods, self.pods = _attempt(pods[0]), pods, []
        for pod in pods:
            agent = agents[pod.spec.nodeName]
            host = agent.listen.rpartition(":")[0]
            self.client.patch(
                Pod.Status,
                pod.metadata.name,
                {
                    "status": {
                        "phase": "Running",
                        "hostIP": host,
                        "podIP": host,
                        "podIPs": [{"ip": host}],
                    }
                },
                namespace=self.namespace,
            )
            volume = next(v for v in pod.spec.volumes if v.csi is not None and v.csi.driver == self.driver)
            target = os.path.join(self.workdir, "pods", pod.metadata.uid, "volumes", volume.name, "mount")
            kubelet.publish(
                agent.endpoint,
                target,
                pod.metadata.name,
                self.namespace,
                pod.metadata.uid,
                attributes=dict(volume.csi.volumeAttributes or {}),
                volume_name=volume.name,
            )
            self.pods.append(
                TrainingPod(
                    pod.metadata.name, agent, target, os.path.join(self.workdir, "logs", f"{pod.metadata.name}.jsonl")
                )
            )
        return self.pods

    def delete_pods(self) -> None:
        """Kills the trainers, unpublishes the volumes on the nodes still up, and confirms the pods' deletion (a pod
        already gone is left: the pod garbage collector deletes those of a deleted Node)."""
        super().delete_pods()
        for pod in self.api_pods:
            try:
                self.client.delete(Pod, pod.metadata.name, namespace=self.namespace, grace_period=0)
            except ApiError as err:
                if err.status.code != 404:
                    raise
        self.api_pods = []
