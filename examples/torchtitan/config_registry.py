"""A TorchTitan config registry whose configs checkpoint through mtc (``--module examples.torchtitan``).

TorchTitan 0.3.0 takes ``--module <importable module> --config <function>``; each function here is a stock
config of TorchTitan's with its ``checkpoint`` section replaced by :class:`mtc_torch.torchtitan.MtcCheckpointManager`.
Everything else is TorchTitan's own; every field stays a command-line flag (``--checkpoint.local-dir /local``).
"""

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from mtc_torch.torchtitan import MtcCheckpointManager


def llama3_debugmodel_mtc() -> Trainer.Config:
    """TorchTitan's llama3 debug model, checkpointing every 5 steps to ``/local`` with a backup every 30 min."""
    config = llama3_debugmodel()
    config.checkpoint = MtcCheckpointManager.Config(
        enable=True,
        interval=5,
        local_dir="/local",
        job_name="llama3",
        backup_interval_minutes=30.0,
        last_save_model_only=False,
    )
    return config
