"""The PyTorch client of the ``pytorch.distributed`` protocol (``pip install 'mtc-checkpointing[torch]'``).

A user of ``torch.distributed.checkpoint`` replaces ``dcp.save(state, checkpoint_id=...)`` with
``manager.save(state, step)``::

    from mtc_torch import CheckpointManager
    manager = CheckpointManager("/local", job_name="llama", backup_interval_minutes=30.0)
    step = manager.load(state_dict)          # None: fresh
    manager.async_save(state_dict, step)     # a Future; blocking time is the copy to CPU only

Importing the package imports torch only when :class:`CheckpointManager` is used (``mtc_torch.protocol`` needs
only PyYAML); it never imports the node agent's packages.
"""

from typing import TYPE_CHECKING, Any

from mtc_torch.protocol import ProtocolError, ReplicatorFailed

if TYPE_CHECKING:
    from mtc_torch.coverage import PartialRestoreError
    from mtc_torch.manager import CheckpointManager

__all__ = ["CheckpointManager", "PartialRestoreError", "ProtocolError", "ReplicatorFailed"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from mtc_torch.manager import CheckpointManager

        return CheckpointManager
    if name == "PartialRestoreError":
        from mtc_torch.coverage import PartialRestoreError

        return PartialRestoreError
    raise AttributeError(f"module 'mtc_torch' has no attribute {name!r}")
