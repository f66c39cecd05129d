"""The PyTorch training process of ``tests/bench/torch_vs_nvrx.py``: a small FSDP2 job on CPU (gloo), run under torchrun.

Every process runs the same model (LAYERS x Linear(WIDTH, WIDTH), ``fully_shard`` per layer, AdamW) on seeded
batches, so a resumed run computes what an uninterrupted one does. What it checkpoints is each rank's own shards
(model parameters and AdamW state, plain local tensors), the same tensors whichever checkpointer runs:

- ``--mode none``: no checkpointing (the baseline step time);
- ``--mode nvrx``: NVRx 0.7.0 ``LocalCheckpointManager`` in ``--local-dir`` (a node-local tmpfs), replicated by
  ``CliqueReplicationStrategy`` in cliques of ``--replication-factor`` ranks ``LOCAL_WORLD_SIZE`` apart (so each
  rank's replica is on the other node), sync save; on CPU through ``tests/bench/nvrx_device_shim.py``;
- ``--mode ours``: ``mtc_torch.CheckpointManager`` on the pod's mount of our ramdisk (``--local-dir``), blocking
  ``save`` (``--async-save``: ``async_save``, whose blocking part is the staging); the node agents replicate.

Global rank 0 prints one JSON line per event on stdout: ``start`` (process start), ``restored`` (step and a
CRC32 of every rank's state right after the load), ``step`` (``train_s``: forward/backward/optimizer,
``save_s``: the checkpoint call, ``time``: wall clock at the end) and ``saved`` (the CRC32 of every rank's
state at a saved step, so the bench can check that a restore is bit-identical).
"""

import argparse
import json
import os
import sys
import time
import zlib

START = time.time()

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def emit(**event) -> None:
    if dist.get_rank() == 0:
        print(json.dumps(event), flush=True)


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # the state a restore loads into, before the first step
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return model, optimizer


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": {name: local shard}, "optim": {name: {key: tensor}}}: this rank's live tensors (not copies), detached
    (they share the parameters' storage without their autograd history, so a checkpointer may write into them)."""
    params = dict(model.named_parameters())
    return {
        "model": {name: p.to_local().detach() for name, p in params.items()},
        "optim": {
            name: {k: (v.to_local() if hasattr(v, "to_local") else v).detach() for k, v in optimizer.state[p].items()}
            for name, p in params.items()
        },
    }


def tensors(state: dict) -> list[torch.Tensor]:
    return [
        t
        for group in state.values()
        for entry in group.values()
        for t in (entry.values() if isinstance(entry, dict) else [entry])
    ]


def crc(state: dict) -> int:
    value = 0
    for t in tensors(state):
        value = zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), value)
    return value


def all_crcs(state: dict) -> list[int]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, crc(state))
    return out


def fresh_dicts(state: dict) -> dict:
    """New dicts at every level, holding the same tensors."""
    return {k: fresh_dicts(v) if isinstance(v, dict) else v for k, v in state.items()}


def copy_into(live: dict, loaded: dict) -> None:
    with torch.no_grad():
        for dst, src in zip(tensors(live), tensors(loaded), strict=True):
            dst.copy_(src)


class NoCheckpoint:
    def load(self, state: dict) -> int | None:
        return None

    def save(self, state: dict, step: int) -> None:
        pass

    def wait(self) -> None:
        pass


class NVRxCheckpoint:
    """NVRx 0.7.0 local checkpointing with clique replication, as its docs use it."""

    def __init__(self, root: str, session: str, replication_jump: int, replication_factor: int):
        from tests.bench import nvrx_device_shim

        nvrx_device_shim.install()
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
            CliqueReplicationStrategy,
        )

        self._wrap = BasicTensorAwareStateDict
        strategy = CliqueReplicationStrategy.from_replication_params(replication_jump, replication_factor)
        self.manager = LocalCheckpointManager(root, session_id=session, repl_strategy=strategy)

    def load(self, state: dict) -> int | None:
        step = self.manager.find_latest()
        if step < 0:
            return None
        loaded, _ = self.manager.load()
        copy_into(state, loaded.state_dict)
        return step

    def save(self, state: dict, step: int) -> None:
        # NVRx hollows the dict it is given (replaces its tensors by placeholders): a fresh dict of the live tensors.
        self.manager.save(self._wrap(fresh_dicts(state)), step)

    def wait(self) -> None:
        pass


class OurCheckpoint:
    """``mtc_torch.CheckpointManager``: blocking ``save``, or ``async_save`` (TORCH.md's API)."""

    def __init__(self, local_dir: str, job_name: str, async_save: bool, backup_every: int):
        from mtc_torch import CheckpointManager

        self.manager = CheckpointManager(local_dir, job_name=job_name, backup_interval_steps=backup_every)
        self.async_save = async_save

    def load(self, state: dict) -> int | None:
        return self.manager.load(state)

    def save(self, state: dict, step: int) -> None:
        if self.async_save:
            self.manager.async_save(state, step)
        else:
            self.manager.save(state, step)

    def wait(self) -> None:
        self.manager.close()  # waits for the pending save, then stops the client's background thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["none", "nvrx", "ours"], required=True)
    parser.add_argument("--local-dir", default="")
    parser.add_argument("--job-name", default="bench")
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--replication-factor", type=int, default=2)
    parser.add_argument("--async-save", action="store_true", help="ours: async_save instead of save")
    parser.add_argument(
        "--backup-every", type=int, default=1_000_000, help="ours: backup-interval-steps (the agents' backups)"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    model, optimizer = build(args.width, args.layers)
    state = local_state(model, optimizer)
    if args.mode == "nvrx":
        checkpoint = NVRxCheckpoint(
            args.local_dir, args.job_name, int(os.environ["LOCAL_WORLD_SIZE"]), args.replication_factor
        )
    elif args.mode == "ours":
        checkpoint = OurCheckpoint(args.local_dir, args.job_name, args.async_save, args.backup_every)
    else:
        checkpoint = NoCheckpoint()
    emit(event="start", time=START)
    restored = checkpoint.load(state)
    if restored is not None:
        emit(event="restored", step=restored, crcs=all_crcs(state), time=time.time())
    step = restored or 0
    rank = dist.get_rank()
    while step < args.steps:
        step += 1
        began = time.time()
        batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(step * 1000 + rank))
        target = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(step * 1000 + rank + 500))
        loss = (model(batch) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        trained = time.time()
        saving = args.mode != "none" and step % args.save_every == 0
        if saving:
            checkpoint.save(state, step)
        done = time.time()
        emit(
            event="step",
            step=step,
            loss=loss.item(),
            train_s=trained - began,
            save_s=done - trained,
            saved=saving,
            time=done,
        )
        if saving:
            emit(event="saved", step=step, crcs=all_crcs(state))
    checkpoint.wait()
    dist.destroy_process_group()


def exit_without_finalizing(code: int = 0) -> None:
    """Ends the process without CPython's finalization, once everything is written.

    torch 2.15 keeps the gloo process group, and so its worker threads, alive after ``destroy_process_group``
    (DTensor's caches hold the FSDP mesh, which holds the group). A worker thread drops its last collective (the
    ``all_gather`` of ``all_crcs``) just after the collective completes; dropping it releases Python tensors, which
    takes the GIL. If that happens once the interpreter is finalizing, CPython ends the thread with ``pthread_exit``,
    whose forced unwind through the work's (noexcept) destructor calls ``std::terminate``: SIGABRT, "terminate
    called without an active exception". It takes a busy machine (our agents replicating the last step) to delay the
    worker thread that long, hence only some runs. Nothing is left to finalize here: the checkpointer is closed, the
    process group destroyed, stdout flushed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    exit_without_finalizing()
