"""TorchTitan's checkpoint manager on the node's ramdisk: ``MtcCheckpointManager`` for TorchTitan >= 0.3.0.

TorchTitan builds its checkpointer from ``Trainer.Config.checkpoint``, typed ``BaseCheckpointManager.Config``: a
config registry function swaps in this manager's ``Config`` and TorchTitan is not otherwise changed::

    from torchtitan.models.llama3.config_registry import llama3_8b
    from mtc_torch.torchtitan import MtcCheckpointManager

    def llama3_8b_mtc():
        config = llama3_8b()
        config.checkpoint = MtcCheckpointManager.Config(enable=True, interval=100, local_dir="/local",
                                                        job_name="llama3", backup_interval_minutes=30.0)
        return config

then ``torchrun ... -m torchtitan.train --module my_registry --config llama3_8b_mtc``; every field is also a
``--checkpoint.*`` flag. Each local rank saves what TorchTitan's own manager saves (model, optimizer, LR
schedulers, dataloader, train state) as its own DCP checkpoint through :class:`mtc_torch.CheckpointManager`; the
node agent picks the step to restore, so ``load_step`` and ``folder`` are not used. Importing this module imports
TorchTitan.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from mtc_torch.manager import CheckpointManager

log = logging.getLogger(__name__)


class MtcCheckpointManager(BaseCheckpointManager):
    """TorchTitan's checkpoint contract served by :class:`mtc_torch.CheckpointManager`.

    Built by TorchTitan's trainer (``config.checkpoint.build(...)``) after ``torch.distributed`` is initialized,
    in every process of the job.

    Args:
        config: the ``checkpoint`` section.
        dataloader: TorchTitan's dataloader (a ``Stateful``), or None.
        model_parts: the model (its pipeline stages, if any).
        optimizers: TorchTitan's ``OptimizersContainer``.
        lr_schedulers: TorchTitan's ``LRSchedulersContainer``.
        states: further ``Stateful`` objects by key (the trainer passes ``{"train_state": trainer}``).
        sd_adapter: unused (Hugging Face exports are TorchTitan's own manager's job).
        base_folder: unused (the ramdisk is ``config.local_dir``).

    Raises:
        ValueError: a bad ``config`` or torchrun environment (see :class:`mtc_torch.CheckpointManager`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        local_dir: str = "/local"
        """The pod's mount of the node's ramdisk."""

        job_name: str = "torchtitan"
        """``job-name`` of ``replicator.yaml`` and of the restore markers."""

        backup_interval_minutes: float | None = None
        """Minutes between backups to object storage; exactly one of it and ``backup_interval_steps``."""

        backup_interval_steps: int | None = None
        """Steps between backups to object storage (an extension of the protocol)."""

        peers_per_node: int = 1
        """``peers-per-node`` of ``replicator.yaml``."""

        assume_data_parallelism: int | None = None
        """How many nodes hold identical steps (HSDP/DDP replicas), if any."""

        async_save: bool = True
        """Save in the background: a step blocks only while the state is copied into host memory."""

        staging_overlaps_step: bool = False
        """With ``async_save``: return from a save once the copy out of GPU memory is queued, and wait for it just
        before the next optimizer step (TorchTitan's ``async_with_pinned_mem`` pattern). Only for models whose
        forward pass changes no saved tensor (no BatchNorm running statistics)."""

        pinned_memory_limit_bytes: int | None = None
        """The most host memory the staging buffers may pin, in bytes (None: one copy of this rank's state)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: concurrent.futures.Future[int] | None = None
        self.interval = config.interval
        self.load_only = config.load_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.async_save = config.async_save
        self.staging_overlaps_step = config.staging_overlaps_step
        if config.load_step != -1:
            log.warning(
                "checkpoint.load_step=%d is ignored: the node agent picks the step to restore", config.load_step
            )
        self.states = dict(states)
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self.manager = CheckpointManager(
            config.local_dir,
            config.job_name,
            backup_interval_minutes=config.backup_interval_minutes,
            backup_interval_steps=config.backup_interval_steps,
            peers_per_node=config.peers_per_node,
            assume_data_parallelism=config.assume_data_parallelism,
            pinned_memory_limit_bytes=config.pinned_memory_limit_bytes,
        )

    def _load(self, step: int = -1) -> bool:
        """Runs the handshake; loads the step the agent restored, if any. Returns whether a step was loaded."""
        restored = self.manager.load(self.states)
        if restored is None:
            log.info("mtc: no checkpoint to restore, starting fresh")
            return False
        log.info("mtc: restored step %d", restored)
        return True

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        return (curr_step == 1 and self.enable_first_step_checkpoint) or last_step or curr_step % self.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Saves ``curr_step`` when it is due; a last step is saved blocking. Returns whether it saved."""
        if not self._should_save(curr_step, last_step):
            return False
        if self.async_save and not last_step:
            self.save_future = self.manager.async_save(
                self.states, curr_step, wait_for_staging=not self.staging_overlaps_step
            )
        else:
            self.manager.save(self.states, curr_step)
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Called before each optimizer step: the last save's copy out of GPU memory must be done by then."""
        self.manager.wait_for_staging()

    def _wait_for_saving(self) -> None:
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        self.manager.close()
