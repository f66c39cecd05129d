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
node agent picks the step to restore. TorchTitan's own ``CheckpointManager`` (``dcp.py``) is kept for what is not
a step of ours: the load on a fresh start (``initial_load_path`` and its options) and the last step's checkpoint in
``checkpoint.folder`` (``last_save_model_only``, ``last_save_in_hf``, ``export_dtype``). Options that cannot be
honoured are refused at start (docs/pytorch.md, "TorchTitan"). Importing this module imports TorchTitan.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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
from torchtitan.components.checkpointer.dcp import CheckpointManager as TitanCheckpointManager

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
        sd_adapter: the model's Hugging Face state dict adapter, or None; TorchTitan's own manager uses it for
            ``initial_load_in_hf`` and ``last_save_in_hf``.
        base_folder: the trainer's dump folder; ``config.folder`` is relative to it.

    Raises:
        ValueError: a bad ``config`` or torchrun environment (see :class:`mtc_torch.CheckpointManager`), or an
            option of ``config`` this manager refuses (:func:`refuse_unsupported`).
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
        refuse_unsupported(config, sd_adapter)
        self.save_future: concurrent.futures.Future[int] | None = None
        self.interval = config.interval
        self.load_only = config.load_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.async_save = config.async_save
        self.staging_overlaps_step = config.staging_overlaps_step
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
        # TorchTitan's own manager over the same states, synchronous and purging nothing: its fresh-start load
        # and its last-step save are TorchTitan's code, not a copy of it.
        titan_config = TitanCheckpointManager.Config(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(BaseCheckpointManager.Config)},
        )
        titan_config.keep_latest_k = 0
        self.titan = TitanCheckpointManager(
            titan_config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states={},
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        self.titan.states = self.states

    def _load(self, step: int = -1) -> bool:
        """Runs the handshake; loads the step the agent restored, if any, else what TorchTitan's own manager
        loads on a fresh start (its ``checkpoint.folder``'s newest step, else ``initial_load_path``, else the
        Hugging Face weights at ``hf_assets_path`` with ``initial_load_in_hf``). Returns whether one was loaded.

        Raises:
            ValueError: ``initial_load_path`` is not a directory (TorchTitan's check).
        """
        restored = self.manager.load(self.states)
        if restored is not None:
            log.info("mtc: restored step %d", restored)
            return True
        log.info("mtc: no checkpoint to restore, starting fresh")
        return bool(self.titan.load())

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        return (curr_step == 1 and self.enable_first_step_checkpoint) or last_step or curr_step % self.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Saves ``curr_step`` when it is due; a last step is saved blocking, then written as TorchTitan's own
        manager writes it to ``checkpoint.folder``/``step-<N>`` (model only in ``export_dtype`` by default,
        Hugging Face safetensors with ``last_save_in_hf``). Returns whether it saved."""
        if not self._should_save(curr_step, last_step):
            return False
        if self.async_save and not last_step:
            self.save_future = self.manager.async_save(
                self.states, curr_step, wait_for_staging=not self.staging_overlaps_step
            )
            return True
        self.manager.save(self.states, curr_step)
        if last_step:  # after our step is committed: a failing write here loses no checkpoint
            self.titan._save_last_step(curr_step)
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Called before each optimizer step: the last save's copy out of GPU memory must be done by then."""
        self.manager.wait_for_staging()

    def _wait_for_saving(self) -> None:
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        self.manager.close()
        self.titan.close()


_KEEP_LATEST_K = next(f.default for f in dataclasses.fields(BaseCheckpointManager.Config) if f.name == "keep_latest_k")


def refuse_unsupported(config: BaseCheckpointManager.Config, sd_adapter: Any) -> None:
    """Refuses the options of TorchTitan's ``checkpoint`` section that :class:`MtcCheckpointManager` cannot honour.

    Raises:
        ValueError: one line naming the first such option and what to do instead.
    """
    refusals = (
        (config.load_step != -1, f"load_step={config.load_step}", "the node agent restores the newest complete step"),
        (
            config.keep_latest_k != _KEEP_LATEST_K,
            f"keep_latest_k={config.keep_latest_k}",
            "the node agent keeps steps (replicator.yaml)",
        ),
        (
            bool(config.exclude_from_loading),
            f"exclude_from_loading={config.exclude_from_loading}",
            "a restore loads every saved state",
        ),
        (
            config.create_seed_checkpoint,
            "create_seed_checkpoint",
            "write the seed with TorchTitan's own checkpointer and point initial_load_path at it",
        ),
        (
            config.initial_load_in_hf and sd_adapter is None,
            "initial_load_in_hf",
            "the model has no state dict adapter",
        ),
    )
    for refused, option, why in refusals:
        if refused:
            raise ValueError(f"checkpoint.{option} is not supported with MtcCheckpointManager: {why}")
