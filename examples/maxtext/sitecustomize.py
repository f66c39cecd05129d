"""CPU-ONLY SHIM for running the stock MaxText trainer on CPU processes. A TPU or GPU pod does not
need it and must not use it.

Python imports ``sitecustomize`` at startup from ``sys.path``; put this directory on ``PYTHONPATH``
of the trainer and set ``MTC_NUM_PROCESSES`` (the job's process count). It then loads
``examples/cpu_cluster.py`` (one level up) which:

- registers a JAX ``ClusterEnv`` that reports ``$MTC_NUM_PROCESSES``: Orbax's multi-tier
  checkpointing hands ``jax.distributed.initialize`` the process id and coordinator address from
  ``jax-init-info.txt``, and on CPU nothing else tells JAX how many processes there are;
- with ``MTC_NUM_SLICES`` > 1, makes CPU devices report ``slice_index`` (process index // processes
  per slice), without which MaxText's multi-slice mesh raises on CPU.

Without ``MTC_NUM_PROCESSES`` it does nothing (and does not import JAX), so other programs of the
same virtualenv start as usual.
"""

import importlib.util
import os
import sys

if "MTC_NUM_PROCESSES" in os.environ:
    # Loaded by path so that only this directory needs to be on PYTHONPATH.
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu_cluster.py")
    _spec = importlib.util.spec_from_file_location("cpu_cluster", _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["cpu_cluster"] = _module
    _spec.loader.exec_module(_module)
    _module.install_from_env()
