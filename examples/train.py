"""Multi-process JAX training example that checkpoints through Orbax MTC.

The script exercises the workload side of Orbax multi-tier checkpointing
(MTC) the way MaxText does:

1. ``initialize_multi_tier_checkpointing(local_dir, ...)`` waits for the node
   agent to write ``jax-init-info.txt``, initializes ``jax.distributed`` from
   it, writes ``replicator.yaml``, waits for the agent to consume it, and then
   waits for a restore marker (``<job>-s<step>-n<rank>-w0.restore``).
2. ``ReplicatorCheckpointManager(local_dir, ...)`` saves every process's
   addressable shards to its own local directory and restores the latest step
   found there.

The model is a tiny two-layer MLP trained with SGD + momentum on synthetic
data that is a deterministic function of the step number, so a run resumed
from step ``S`` produces bit-identical parameters and losses to a run that was
never interrupted.

Parallelism follows what MTC assumes: the global mesh has shape
``(num_slices, processes_per_slice)`` with axes ``('replica', 'model')``. The
training batch is split across the ``replica`` axis (data parallelism across
slices) and the parameters are replicated across it, while the hidden
dimension is sharded across the processes of a slice. Process ``i`` of slice
``k`` therefore holds the same parameter shard as process ``i`` of every other
slice: those are the data-parallel peers listed in ``peer-ranks``.

JAX on CPU cannot discover the number of processes by itself, so the script
registers the CPU-only ``ClusterEnv`` of ``examples/cpu_cluster.py``, which
reads it from ``MTC_NUM_PROCESSES`` (set from ``--nodes`` when given).
Process id and coordinator address come from ``jax-init-info.txt`` via Orbax.

Every event goes to stdout as one JSON object per line (anything else that
would have gone to stdout, e.g. Gloo's connection messages, goes to stderr)::

  {"event": "init", "rank": 0, ...}
  {"event": "restored", "step": 6 | null, "rank": 0}
  {"event": "step", "step": 7, "loss": 0.12, "time": 1700000000.0}  # rank 0
  {"event": "saved", "step": 9, "rank": 0}
  {"event": "preempted", "step": 11, "rank": 0}  # after SIGTERM, see below
  {"event": "done", "rank": 0}

A ``saved`` event is printed only after the save has finished, i.e. after the
step directory has been committed (renamed from ``<step>.orbax-checkpoint-tmp``
to ``<step>``) in this process's local directory. Besides every multiple of
``--save-interval-steps``, Orbax's default save policy also saves the first
step of a run that starts without any checkpoint (step 1).

JAX's preemption service catches SIGTERM (it does not kill the process). When
any process gets SIGTERM, all processes agree on a step, Orbax saves it, and
the script stops after that step with a ``preempted`` event.

Arguments that argparse does not know are handed to absl, e.g. ``--v=2``
turns on Orbax's verbose MTC logging (on stderr).
"""

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import flags

# Registers the CPU-only process-count ClusterEnv (this script runs with examples/ on sys.path).
from cpu_cluster import NUM_PROCESSES_ENV
from etils import epath
from jax.experimental import multihost_utils

# This module path works on Orbax 0.11.x and (as a re-export) on 0.12.x.
from orbax.checkpoint.experimental.emergency import (
    replicator_checkpoint_manager as mtc_manager,
)
from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
    initialization as mtc_initialization,
)

INPUT_DIM = 16
HIDDEN_PER_SHARD = 16
EXAMPLES_PER_SLICE = 32
LEARNING_RATE = 0.05
MOMENTUM = 0.9


class EventStream:
    """Writes one JSON object per line to the process's original stdout.

    Native code prints to file descriptor 1 as well (Gloo reports its peer
    connections there). To keep stdout a pure JSON-lines stream, the events get
    a private duplicate of the original stdout and descriptor 1 (and with it
    ``sys.stdout``) is pointed at stderr.
    """

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def emit(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """Parses the script's flags; returns them and the leftover absl flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local-dir", required=True, help="The pod's ramdisk directory.")
    parser.add_argument("--run-name", required=True, help="Job name written to replicator.yaml.")
    parser.add_argument("--num-slices", type=int, required=True)
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        help=f"Total number of processes (default: ${NUM_PROCESSES_ENV}).",
    )
    parser.add_argument(
        "--data-parallelism",
        type=int,
        default=None,
        help="assume-data-parallelism for replicator.yaml (default: num slices).",
    )
    parser.add_argument("--steps", type=int, required=True, help="Total training steps.")
    parser.add_argument("--save-interval-steps", type=int, required=True)
    backup = parser.add_mutually_exclusive_group(required=True)
    backup.add_argument("--backup-interval-steps", type=int)
    backup.add_argument("--backup-interval-minutes", type=int)
    parser.add_argument(
        "--ballast-mib",
        type=int,
        default=0,
        help=(
            "MiB of random data per rank carried in the state unchanged, so"
            " checkpoints have realistic sizes without the compute (benches)."
        ),
    )
    parser.add_argument(
        "--async-save",
        action="store_true",
        help=("Train on while Orbax finishes a save (its default); 'saved' then means started (benches)."),
    )
    parser.add_argument(
        "--ballast-layout",
        choices=sorted(BALLAST_LAYOUTS),
        default="per-rank",
        help=(
            "per-rank: every process's ballast differs; data-parallel: the"
            " same across slices, as a data-parallel state is."
        ),
    )
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="Seconds to sleep after every step.",
    )
    parser.add_argument(
        "--dump-dir",
        default=None,
        help=(
            "If set, every rank writes the full state as"
            " <dump-dir>/rank<r>-step<s>.npz at every saved step and after a"
            " restore."
        ),
    )
    args, absl_argv = parser.parse_known_args()
    if args.nodes is not None:
        os.environ[NUM_PROCESSES_ENV] = str(args.nodes)
    elif NUM_PROCESSES_ENV not in os.environ:
        parser.error(f"--nodes or ${NUM_PROCESSES_ENV} is required.")
    return args, absl_argv


def make_mesh(num_slices: int) -> jax.sharding.Mesh:
    """Builds the ``(replica, model)`` mesh; one mesh row per slice."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) % num_slices:
        raise ValueError(f"{len(devices)} devices cannot be split into {num_slices} slices.")
    grid = np.array(devices).reshape(num_slices, len(devices) // num_slices)
    return jax.sharding.Mesh(grid, ("replica", "model"))


# The ballast's partition spec per --ballast-layout: one shard per process, or per process of a slice.
BALLAST_LAYOUTS = {
    "per-rank": jax.sharding.PartitionSpec(("replica", "model")),
    "data-parallel": jax.sharding.PartitionSpec("model"),
}


def state_specs(ballast: str | None) -> dict[str, Any]:
    """Partition specs of the training state, with the ballast if its layout is given."""
    p = jax.sharding.PartitionSpec
    params = {
        "w1": p(None, "model"),
        "b1": p("model"),
        "w2": p("model", None),
        "b2": p(),
    }
    specs = {"params": params, "momentum": dict(params), "step": p()}
    return {**specs, "ballast": BALLAST_LAYOUTS[ballast]} if ballast else specs


def global_array(
    mesh: jax.sharding.Mesh,
    spec: jax.sharding.PartitionSpec,
    value: np.ndarray,
) -> jax.Array:
    """Builds a global array from a host value that every process computes."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def make_ballast(mesh: jax.sharding.Mesh, mib: int, layout: str) -> jax.Array:
    """``mib`` MiB of deterministic random float32 per process, each shard built where it lives."""
    per_shard = (mib << 20) // 4
    shards = mesh.size if layout == "per-rank" else mesh.shape["model"]
    sharding = jax.sharding.NamedSharding(mesh, BALLAST_LAYOUTS[layout])

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        return np.random.default_rng(index[0].start or 0).random(per_shard, dtype=np.float32)

    return jax.make_array_from_callback((per_shard * shards,), sharding, shard)


def init_state(mesh: jax.sharding.Mesh, ballast_mib: int, ballast_layout: str = "per-rank") -> dict[str, Any]:
    """Returns the deterministic step-0 training state."""
    hidden = HIDDEN_PER_SHARD * mesh.shape["model"]
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(0, INPUT_DIM**-0.5, (INPUT_DIM, hidden)),
        "b1": np.zeros((hidden,)),
        "w2": rng.normal(0, hidden**-0.5, (hidden, 1)),
        "b2": np.zeros((1,)),
    }
    host_state = {
        "params": params,
        "momentum": {k: np.zeros_like(v) for k, v in params.items()},
        "step": np.array(0),
    }
    host_state = jax.tree.map(
        lambda v: v.astype(np.int32 if v.dtype.kind == "i" else np.float32),
        host_state,
    )
    state = jax.tree.map(lambda v, s: global_array(mesh, s, v), host_state, state_specs(None))
    return {**state, "ballast": make_ballast(mesh, ballast_mib, ballast_layout)} if ballast_mib else state


def make_batch(mesh: jax.sharding.Mesh, step: int) -> tuple[jax.Array, jax.Array]:
    """Returns the global batch for ``step``, split across slices."""
    rng = np.random.default_rng(step)
    batch = EXAMPLES_PER_SLICE * mesh.shape["replica"]
    x = rng.standard_normal((batch, INPUT_DIM)).astype(np.float32)
    teacher = np.random.default_rng(1234).standard_normal((INPUT_DIM, 1))
    y = np.tanh(x @ teacher).astype(np.float32)
    spec = jax.sharding.PartitionSpec("replica", None)
    return global_array(mesh, spec, x), global_array(mesh, spec, y)


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array):
    """Mean squared error of the MLP on one batch."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    pred = hidden @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def make_train_step(mesh: jax.sharding.Mesh, ballast: str | None):
    """Returns the jitted SGD + momentum step: (state, x, y) -> (state, loss); ``ballast``: its layout, if any."""
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), state_specs(ballast))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        momentum = jax.tree.map(lambda m, g: MOMENTUM * m + g, state["momentum"], grads)
        params = jax.tree.map(lambda p, m: p - LEARNING_RATE * m, state["params"], momentum)
        new_state = {
            **state,  # the ballast, if any, unchanged
            "params": params,
            "momentum": momentum,
            "step": state["step"] + 1,
        }
        return new_state, loss

    return jax.jit(train_step, out_shardings=(shardings, replicated))


def dump_state(dump_dir: str, rank: int, step: int, state: dict[str, Any]) -> None:
    """Gathers the full state and writes it atomically as an ``.npz`` file.

    This is a collective: every process must call it.
    """
    host_state = multihost_utils.process_allgather(state, tiled=True)
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(host_state)
    }
    os.makedirs(dump_dir, exist_ok=True)
    final = os.path.join(dump_dir, f"rank{rank}-step{step}.npz")
    tmp = final + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **flat)
    os.replace(tmp, final)


def main() -> None:
    args, absl_argv = parse_args()
    events = EventStream()
    # Orbax's restore path reads absl flags; they must be parsed before use.
    flags.FLAGS(sys.argv[:1] + absl_argv)

    local_dir = epath.Path(args.local_dir)
    mtc_initialization.initialize_multi_tier_checkpointing(
        local_dir,
        backup_interval_minutes=args.backup_interval_minutes,
        backup_interval_steps=args.backup_interval_steps,
        num_slices=args.num_slices,
        run_name=args.run_name,
        data_parallelism=args.data_parallelism,
    )
    rank = jax.process_index()
    mesh = make_mesh(args.num_slices)
    events.emit(
        "init",
        rank=rank,
        process_count=jax.process_count(),
        device_count=jax.device_count(),
        num_slices=args.num_slices,
        mesh_shape=dict(mesh.shape),
        local_dir=str(local_dir),
    )

    manager = mtc_manager.ReplicatorCheckpointManager(
        local_dir,
        mtc_manager.ReplicatorCheckpointManagerOptions(save_interval_steps=args.save_interval_steps),
        global_mesh=mesh,
    )
    state = init_state(mesh, args.ballast_mib, args.ballast_layout)
    restored_step = manager.latest_step()
    if restored_step is not None:
        abstract_state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            state,
        )
        restored = manager.restore(
            restored_step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract_state,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                )
            ),
        )
        state = restored["state"]
        if args.dump_dir:
            dump_state(args.dump_dir, rank, restored_step, state)
    events.emit("restored", step=restored_step, rank=rank)

    train_step = make_train_step(mesh, args.ballast_layout if args.ballast_mib else None)
    for step in range((restored_step or 0) + 1, args.steps + 1):
        x, y = make_batch(mesh, step)
        state, loss = train_step(state, x, y)
        loss_value = float(loss.addressable_data(0))
        if rank == 0:
            events.emit("step", step=step, loss=loss_value, time=time.time())
        save_args = ocp.args.Composite(state=ocp.args.PyTreeSave(state))
        if manager.save(step, args=save_args):
            if not args.async_save:
                manager.wait_until_finished()
            events.emit("saved", step=step, rank=rank)
            if args.dump_dir:
                dump_state(args.dump_dir, rank, step, state)
        if manager.reached_preemption(step):
            # JAX turns SIGTERM into a preemption notice that all processes agree
            # on at a common step; the save above has already covered that step.
            events.emit("preempted", step=step, rank=rank)
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)

    manager.wait_until_finished()
    manager.close()
    events.emit("done", rank=rank)


if __name__ == "__main__":
    main()
