"""A torchrun-launched PyTorch training example that checkpoints through ``mtc_torch`` (CPU, gloo).

Run it as, on each node ``i`` of ``N``::

  torchrun --nnodes N --node-rank i --nproc-per-node W --master-addr ... --master-port ... \\
      examples/train_torch.py --local-dir /local --job-name demo --steps 100 --save-interval-steps 5

The model is a tiny MLP wrapped with FSDP2's ``fully_shard`` (each layer, then the root) over all ranks, trained
with AdamW on synthetic data that is a deterministic function of the step and the global rank, so a run resumed
from step ``S`` produces bit-identical parameters, optimizer state and losses to a run that was never interrupted.
Every node's local rank 0 speaks the ``pytorch.distributed`` protocol to the node agent (``CheckpointManager``);
the other local ranks learn the restored step through the process group.

Every event goes to stdout as one JSON object per line, from every node's local rank 0 (``node`` names it)::

  {"event": "init", "node": 0, "rank": 0, "world": 4, "local_world": 2}
  {"event": "restored", "step": 6 | null, "node": 0}
  {"event": "step", "step": 7, "loss": 0.12, "node": 0, "time": 1700000000.0}  # the mean loss over all ranks
  {"event": "saved", "step": 9, "node": 0}  # after the commit rename of <local>/9.tmp to <local>/9
  {"event": "done", "node": 0}

With ``--dump-dir``, every rank writes its local shards of the model and optimizer state as
``<dump-dir>/rank<global rank>-step<s>.npz`` at every saved step and after a restore (as ``examples/train.py``
does), for bit-identical comparisons. ``--steps`` larger than the run's life trains until the process is killed.

``--data-parallelism D`` shards with HSDP instead: D replica groups of ``world / D`` ranks each (consecutive
nodes), so local rank r of every node in the same position of each group holds identical shards and the agent
keeps one copy of them (``assume-data-parallelism``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtc_torch import CheckpointManager

DIM, HIDDEN, BATCH = 16, 64, 8
_print_lock = threading.Lock()


def emit(**event: Any) -> None:
    """One JSON line on stdout."""
    with _print_lock:
        print(json.dumps(event), flush=True)


class Model(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, DIM)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class TrainState(Stateful):
    """The model and optimizer as one DCP ``Stateful`` (sharded state dicts: each rank's DTensor shards)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic batch of ``rank`` at ``step``: x of shape (BATCH, DIM), target sin(x)."""
    gen = torch.Generator().manual_seed(step * 1_000_003 + rank)
    x = torch.randn(BATCH, DIM, generator=gen)
    return x, torch.sin(x)


def flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every leaf of a (nested) state dict as a numpy array, DTensors as their local shard."""
    out: dict[str, np.ndarray] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out.update(flatten(value, f"{prefix}/{i}"))
    elif isinstance(tree, DTensor):
        out[prefix] = tree.to_local().detach().numpy().copy()
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree.detach().numpy().copy()
    else:  # hyperparameters and flags (None, bool, float): their repr, never an object array
        out[prefix] = np.asarray(repr(tree))
    return out


def dump(dump_dir: str | None, step: int, state: TrainState) -> None:
    """``<dump_dir>/rank<global rank>-step<step>.npz``, written whole (tmp + rename)."""
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        final = os.path.join(dump_dir, f"rank{dist.get_rank()}-step{step}.npz")
        with open(final + ".tmp", "wb") as f:
            np.savez(f, **flatten(state.state_dict()))
        os.replace(final + ".tmp", final)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--local-dir", required=True, help="the pod's mount of the node's ramdisk")
    parser.add_argument("--job-name", required=True)
    parser.add_argument("--steps", type=int, default=20, help="train up to this step")
    parser.add_argument("--save-interval-steps", type=int, default=5)
    parser.add_argument(
        "--backup-interval-steps",
        type=int,
        default=None,
        help="backup-interval-steps for the agent (default: backup-interval-minutes 30)",
    )
    parser.add_argument(
        "--data-parallelism",
        type=int,
        default=None,
        help="HSDP with this many replica groups, told to the agent as assume-data-parallelism",
    )
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--async-save", action="store_true", help="save with async_save (blocking: staging only)")
    parser.add_argument("--dump-dir", default=None, help="write each rank's state at every save and after a restore")
    parser.add_argument(
        "--hidden", type=int, default=HIDDEN, help="the hidden width: the state is about 12 x hidden^2 bytes"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(args.hidden)
    # HSDP: replicate across the groups, shard within one; else FSDP over every rank.
    groups = args.data_parallelism or 1
    mesh = (
        init_device_mesh("cpu", (groups, world // groups), mesh_dim_names=("replicate", "shard"))
        if groups > 1
        else None
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, optimizer)

    manager = CheckpointManager(
        args.local_dir,
        args.job_name,
        backup_interval_minutes=None if args.backup_interval_steps else 30.0,
        backup_interval_steps=args.backup_interval_steps,
        assume_data_parallelism=args.data_parallelism,
    )
    node, speaker = manager.topology.node_rank, manager.topology.local_rank == 0
    if speaker:
        emit(event="init", node=node, rank=rank, world=world, local_world=manager.topology.local_world_size)
    app = {"app": state}
    restored = manager.load(app)
    if speaker:
        emit(event="restored", step=restored, node=node)
    if restored is not None:
        dump(args.dump_dir, restored, state)

    pending: list[tuple[int, Any]] = []
    for step in range((restored or 0) + 1, args.steps + 1):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if speaker:
            emit(event="step", step=step, loss=float(mean) / world, node=node, time=time.time())
        if step % args.save_interval_steps == 0:
            dump(args.dump_dir, step, state)
            if args.async_save:
                pending.append((step, manager.async_save(app, step)))
            else:
                manager.save(app, step)
                if speaker:
                    emit(event="saved", step=step, node=node)
        for saved, future in [p for p in pending if p[1].done()]:
            future.result()
            pending.remove((saved, future))
            if speaker:
                emit(event="saved", step=saved, node=node)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    manager.close()
    for saved, future in pending:
        future.result()
        if speaker:
            emit(event="saved", step=saved, node=node)
    dist.barrier()
    if speaker:
        emit(event="done", node=node)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
