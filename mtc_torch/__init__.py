"""The PyTorch client of the ``pytorch.distributed`` protocol (``pip install mtc-torch``).

A user of ``torch.distributed.checkpoint`` replaces ``dcp.save(state, checkpoint_id=...)`` with
``manager.save(state, step)``::

    from mtc_torch import CheckpointManager
    manager = CheckpointManager("/local", job_name="llama", backup_interval_minutes=30.0)
    step = manager.load(state_dict)          # None: fresh
    manager.async_save(state_dict, step)     # a Future; blocking time is the copy to CPU only

A step (from the ramdisk, a staged restore, or downloaded from the backup store) loads with stock DCP at any world
size and mesh through :class:`StepReader`: ``dcp.load(state_dict, storage_reader=StepReader(step_dir))``.

Importing the package imports torch only when :class:`CheckpointManager` or :class:`StepReader` is used (``mtc_torch.protocol`` needs
only PyYAML); it never imports the node agent's packages.
"""

from typing import TYPE_CHECKING, Any

from mtc_torch.protocol import ProtocolError, ReplicatorFailed

if TYPE_CHECKING:
    from mtc_torch.coverage import PartialRestoreError
    from mtc_torch.manager import CheckpointManager
    from mtc_torch.reader import StepReader

__all__ = ["CheckpointManager", "PartialRestoreError", "ProtocolError", "ReplicatorFailed", "StepReader"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from mtc_torch.manager import CheckpointManager

        return CheckpointManager
    if name == "PartialRestoreError":
        from mtc_torch.coverage import PartialRestoreError

        return PartialRestoreError
    if name == "StepReader":
        from mtc_torch.reader import StepReader

        return StepReader
    raise AttributeError(f"module 'mtc_torch' has no attribute {name!r}")
