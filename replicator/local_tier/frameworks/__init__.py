"""The training frameworks the node agent speaks with through files in the client dir: Orbax, and
PyTorch jobs that save with ``torch.distributed.checkpoint`` (``pytorch.distributed``).

``base.Framework`` names what the node needs from one; each module here implements it for one
framework, and ``REGISTRY`` maps the framework's name to its instance. A job chooses its framework
with the volume attribute ``framework`` (``DEFAULT``, ``orbax``, when absent: also the framework
of a ramdisk made before frameworks were recorded); its ramdisk records the name
(``JobMeta.framework``), so an agent restart, an idle ramdisk and the peer tier all read the client
dir the way its job writes it. The name is the one the job also writes in ``replicator.yaml``
(``framework:``), which each framework checks when it parses that file.

A second framework is one module with a class satisfying ``Framework`` plus one line in
``REGISTRY``.
"""

from csi_driver.volume_request import DEFAULT_FRAMEWORK as DEFAULT
from replicator.local_tier.frameworks.base import Files, Framework, InvalidReplicatorConfig, StepScan
from replicator.local_tier.frameworks.orbax import Orbax
from replicator.local_tier.frameworks.pytorch import PyTorchDistributed

__all__ = [
    "DEFAULT",
    "REGISTRY",
    "Files",
    "Framework",
    "InvalidReplicatorConfig",
    "StepScan",
    "UnknownFramework",
    "get",
]

# Framework name -> its (shared, stateless) implementation.
REGISTRY: dict[str, Framework] = {framework.name: framework for framework in (Orbax(), PyTorchDistributed())}


class UnknownFramework(ValueError):
    """No framework of that name is registered."""


def get(name: str) -> Framework:
    """The framework called ``name``.

    Raises:
      UnknownFramework: no such framework is registered.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownFramework(f"unknown framework {name!r}: this node serves {', '.join(sorted(REGISTRY))}") from None
