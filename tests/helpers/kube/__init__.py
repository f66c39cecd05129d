"""A real Kubernetes on this machine for ``make e2e-k8s`` (tests/k8s) and ``make e2e-deploy`` (tests/deploy).

- ``pki``: the CA, serving and client certificates, and the service-account keys (``cryptography``).
- ``control_plane``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the JobSet controller
  as processes on 127.0.0.1 (or an address of the deployment suite's network), stopped by PID; Node objects with
  no kubelet behind them.
- ``node``: a real node (containerd and a kubelet); ``images``: the busybox images it runs.
- ``deploy_node``, ``pod_network``, ``deployment``, ``training_jobset``: the deployment suite's nodes (each in a
  mount namespace of its own), pod network, kube-proxy and CoreDNS, the README's quick start, and a training JobSet.
"""

from tests.helpers.kube.control_plane import JOBSET_VERSION, Binaries, ControlPlane, register_node, write_kubeconfig

__all__ = ["JOBSET_VERSION", "Binaries", "ControlPlane", "register_node", "write_kubeconfig"]
