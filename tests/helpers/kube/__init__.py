"""A real Kubernetes on this machine for ``make e2e-k8s`` (tests/k8s).

- ``pki``: the CA, serving and client certificates, and the service-account keys (``cryptography``).
- ``control_plane``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the JobSet controller
  as processes on 127.0.0.1, stopped by PID; Node objects with no kubelet behind them.
"""

from tests.helpers.kube.control_plane import JOBSET_VERSION, Binaries, ControlPlane, register_node, write_kubeconfig

__all__ = ["JOBSET_VERSION", "Binaries", "ControlPlane", "register_node", "write_kubeconfig"]
