"""The training process of the goodput bench's Orbax-only setups (``tests/bench/goodput.py``): the job of
``examples/train.py`` (same mesh, state, batches and step), checkpointed by Orbax alone, without node agents.

- ``--mode persistent``: Orbax's ordinary ``CheckpointManager`` (async saves, Orbax's default) to
  ``--persistent-dir`` every ``--persistent-interval-steps``;
- ``--mode emergency``: ``orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager``, local
  saves to ``--local-dir`` (a tmpfs, the node's RAM) every ``--save-interval-steps`` and persistent saves to
  ``--persistent-dir`` every ``--persistent-interval-steps``. Multi-slice CPU devices report their slice through
  ``examples/cpu_cluster.py``'s shim, as a multi-slice TPU job's do.

JAX is initialized directly (``--process-id``, ``--coordinator``, ``--nodes``), as a JobSet's pods would without
our agents. Events go to stdout as ``examples/train.py`` prints them (``init``, ``restored``, ``step`` with
``time`` from rank 0, ``done``).
"""

import argparse
import os
import sys
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
)

import cpu_cluster
import jax
import orbax.checkpoint as ocp
import train
from absl import flags
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["persistent", "emergency"], required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--num-slices", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of JAX's distributed coordinator (process 0).")
    parser.add_argument("--local-dir", help="The node's tmpfs directory (--mode emergency).")
    parser.add_argument("--persistent-dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-interval-steps", type=int, default=0, help="Local saves (--mode emergency).")
    parser.add_argument("--persistent-interval-steps", type=int, required=True)
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB per process, the same across slices.")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    if args.mode == "emergency" and not (args.local_dir and args.save_interval_steps):
        parser.error("--mode emergency needs --local-dir and --save-interval-steps")
    return args


def make_manager(args: argparse.Namespace, mesh: jax.sharding.Mesh, abstract_state):
    """The setup's checkpoint manager (keeping two steps per tier)."""
    if args.mode == "persistent":
        options = ocp.CheckpointManagerOptions(save_interval_steps=args.persistent_interval_steps, max_to_keep=2)
        return ocp.CheckpointManager(args.persistent_dir, options=options)
    options = emergency.CheckpointManagerOptions(
        local=emergency.LocalCheckpointOptions(save_interval_steps=args.save_interval_steps, max_to_keep=2),
        persistent=emergency.PersistentCheckpointOptions(
            save_interval_steps=args.persistent_interval_steps, max_to_keep=2
        ),
    )
    return emergency.CheckpointManager(
        args.local_dir, args.persistent_dir, global_mesh=mesh, abstract_state=abstract_state, options=options
    )


def main() -> None:
    args = parse_args()
    events = train.EventStream()
    flags.FLAGS(sys.argv[:1])  # the emergency manager's restore reads absl flags
    cpu_cluster.report_slice_index(args.nodes // args.num_slices)
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.nodes, process_id=args.process_id
    )
    # What Orbax's multi-tier initialization does after JAX's: the emergency manager maps processes to devices by them.
    ocp.multihost.initialize_runtime_to_distributed_ids()
    ocp.multihost.initialize_distributed_to_device_ids()
    rank = jax.process_index()
    mesh = train.make_mesh(args.num_slices)
    events.emit("init", rank=rank, process_count=jax.process_count(), mode=args.mode)
    state = train.init_state(mesh, args.ballast_mib, "data-parallel")
    abstract_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    manager = make_manager(args, mesh, abstract_state)
    restored_step = manager.latest_step()
    if restored_step is not None:
        if args.mode == "persistent":
            state = manager.restore(restored_step, args=ocp.args.StandardRestore(abstract_state))
        else:
            state = manager.restore(restored_step)["state"]
    restored_step = None if restored_step is None else int(restored_step)  # the emergency manager's is a NumPy integer
    events.emit("restored", step=restored_step, rank=rank)

    train_step = train.make_train_step(mesh, "data-parallel" if args.ballast_mib else None)
    for step in range((restored_step or 0) + 1, args.steps + 1):
        x, y = train.make_batch(mesh, step)
        state, loss = train_step(state, x, y)
        loss_value = float(loss.addressable_data(0))
        if rank == 0:
            events.emit("step", step=step, loss=loss_value, time=time.time())
        save_args = (
            ocp.args.StandardSave(state)
            if args.mode == "persistent"
            else ocp.args.Composite(state=ocp.args.PyTreeSave(state))
        )
        if manager.save(step, args=save_args):
            events.emit("saved", step=step, rank=rank)  # started; Orbax finishes it in the background
        if args.step_sleep:
            time.sleep(args.step_sleep)
    manager.wait_until_finished()
    manager.close()
    events.emit("done", rank=rank)


if __name__ == "__main__":
    main()
