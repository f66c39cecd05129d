"""A PyTorch job on the local cluster: each pod runs torchrun with several local ranks of
``examples/train_torch.py``, checkpointing through ``mtc_torch`` (the ``pytorch.distributed`` files).

torchrun runs under the torch virtualenv (``make torch-setup``: ``.venv-torch``, or ``MTC_TORCH_PYTHON``),
which holds torch, numpy, PyYAML and the client (``clients/torch``, the ``mtc-torch`` distribution a training
image gets with ``pip install mtc-torch``): none of the node agent's dependencies.
"""

import dataclasses
import os

from examples.local_cluster import LocalJob, Pod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_TORCH = os.path.join(ROOT, "examples", "train_torch.py")
TORCH_PYTHON = os.environ.get("MTC_TORCH_PYTHON", os.path.join(ROOT, ".venv-torch", "bin", "python"))


@dataclasses.dataclass
class TorchrunJob(LocalJob):
    """``LocalJob`` with torchrun pods: pod ``i`` is node rank ``i`` (``--node-rank``, static
    rendezvous at 127.0.0.1:``jax_port``), with ``nproc_per_node`` local ranks, as a JobSet that
    launches torchrun with ``--node-rank=$JOB_COMPLETION_INDEX`` does.

    Attributes:
      nproc_per_node: local ranks per node (torchrun's ``--nproc-per-node``).
      python: the virtualenv's Python that runs torchrun and its workers.
    """

    framework: str = "pytorch.distributed"
    nproc_per_node: int = 2
    python: str = TORCH_PYTHON

    def train_command(self, pod: Pod) -> list[str]:
        """torchrun for ``pod`` followed by ``worker_command(pod)``."""
        return [
            self.python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(self.agents)),
            "--nproc-per-node",
            str(self.nproc_per_node),
            "--node-rank",
            str(self.pods.index(pod)),
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(self.jax_port),
            *self.worker_command(pod),
        ]

    def worker_command(self, pod: Pod) -> list[str]:
        """What torchrun starts on every local rank: ``examples/train_torch.py`` (a subclass may run another trainer)."""
        return [TRAIN_TORCH, "--local-dir", pod.target, "--job-name", self.name, *self.train_args]

    def train_env(self) -> dict[str, str]:
        """One thread per local rank (the machine's cores are shared by every pod) and ``NNODES``."""
        return {**os.environ, "NNODES": str(len(self.agents)), "OMP_NUM_THREADS": "1"}
