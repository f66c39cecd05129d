"""CPU-only stand-ins for what JAX learns from a TPU or GPU pod's platform.

A TPU or GPU pod needs none of this. Multi-process JAX on CPU (the demo, the tests, MaxText on
this machine) lacks two facts that accelerators report:

- **The process count.** Orbax's multi-tier checkpointing calls
  ``jax.distributed.initialize(process_id, coordinator_address)`` with the values from
  ``jax-init-info.txt``; the number of processes must come from JAX's cluster detection.
  Importing this module registers :class:`EnvProcessCountCluster`, which reads it from
  ``$MTC_NUM_PROCESSES``.
- **The slice of a device.** CPU devices have no ``slice_index``, so a mesh over more than one
  slice (``jax.experimental.mesh_utils.create_hybrid_device_mesh``, which MaxText uses when
  ``num_slices > 1``) raises. :func:`report_slice_index` makes every CPU device report
  ``process_index // processes_per_slice``, as a multi-slice TPU job's devices do.

``examples/train.py`` imports it; ``examples/maxtext/sitecustomize.py`` loads it into the stock
MaxText trainer.
"""

import os

import jax
from jax._src import clusters

NUM_PROCESSES_ENV = "MTC_NUM_PROCESSES"
NUM_SLICES_ENV = "MTC_NUM_SLICES"


class EnvProcessCountCluster(clusters.ClusterEnv):
    """Tells ``jax.distributed.initialize`` the process count from ``$MTC_NUM_PROCESSES``.

    Orbax passes ``process_id`` and ``coordinator_address`` explicitly, so only the process count
    has to come from cluster detection.
    """

    name = "mtc_env_process_count"

    @classmethod
    def is_env_present(cls) -> bool:
        return NUM_PROCESSES_ENV in os.environ

    @classmethod
    def get_coordinator_address(cls, timeout_secs: int | None, override_coordinator_port: str | None) -> str:
        raise RuntimeError("The coordinator address comes from jax-init-info.txt.")

    @classmethod
    def get_process_count(cls) -> int:
        return int(os.environ[NUM_PROCESSES_ENV])

    @classmethod
    def get_process_id(cls) -> int:
        raise RuntimeError("The process id comes from jax-init-info.txt.")


# Subclassing registers the environment at the end of the detection list; move it to the front so
# that, e.g., JAX's Kubernetes detection cannot win in a pod.
# pylint: disable=protected-access
clusters.ClusterEnv._cluster_types.remove(EnvProcessCountCluster)
clusters.ClusterEnv._cluster_types.insert(0, EnvProcessCountCluster)
# pylint: enable=protected-access


def report_slice_index(processes_per_slice: int) -> None:
    """Makes CPU devices report ``slice_index = process_index // processes_per_slice``.

    Devices of other platforms keep their own attribute: the property raises ``AttributeError``
    for them, which falls through to the device's native attribute lookup.

    Raises:
      ValueError: ``processes_per_slice`` is not positive.
    """
    if processes_per_slice < 1:
        raise ValueError(f"processes_per_slice must be positive, got {processes_per_slice}")

    def slice_index(device: jax.Device) -> int:
        if device.platform != "cpu":
            raise AttributeError("slice_index")
        return device.process_index // processes_per_slice

    jax.Device.slice_index = property(slice_index)


def install_from_env() -> None:
    """Applies the slice shim when ``$MTC_NUM_SLICES`` is set (the process count shim is already
    registered by importing this module).

    Raises:
      ValueError: ``$MTC_NUM_SLICES`` does not divide ``$MTC_NUM_PROCESSES``.
    """
    slices = int(os.environ.get(NUM_SLICES_ENV, "1"))
    if slices > 1:
        processes = int(os.environ[NUM_PROCESSES_ENV])
        if processes % slices:
            raise ValueError(f"${NUM_SLICES_ENV}={slices} does not divide ${NUM_PROCESSES_ENV}={processes}")
        report_slice_index(processes // slices)
