"""A resharded load beside a same-size load, into GPU memory when there is one (issue 50: the new step layout must keep
issue 36's restore rates, and a load at another world size must come close to them).

Two steps of the same state (``--gib`` GiB of fp32 in 256 MiB tensors, seeded values) are written by
``mtc_torch.storage.DeterministicWriter`` (8 files, 8 threads) into a directory on tmpfs: one by a single rank, one
by 2 ranks under torchrun (gloo, CPU; each rank stores its ``Shard(0)`` half as a DTensor, so its ``.metadata`` holds
only its chunk). One process then loads each into whole tensors on the GPU (else the CPU) with
``dcp.load(..., storage_reader=mtc_torch.StepReader(step, threads=16), no_dist=True)``: the 2-rank step through
the merged metadata, each destination filled from two rank directories. Three loads of each; the medians, their
ratio (goal: resharded <= 1.5 x same size) and bit-identity against the seeded values print as one JSON line.

    python -m tests.bench.torch_reshard_load --gib 16 --tmp /mnt/ramdisk/reshard   # a Python with torch
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

ROWS, COLS = 8192, 8192  # fp32: 256 MiB per tensor
LOADS = 3


def values(index: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(index))


def tensors(gib: float) -> int:
    return max(1, int(gib * (1 << 30) // (ROWS * COLS * 4)))


def save(step: str, gib: float) -> None:
    """One rank's part of a save (under torchrun): its ``Shard(0)`` rows of every tensor."""
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from mtc_torch.storage import DeterministicWriter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = ROWS // world
    state = {
        f"w{i}": DTensor.from_local(values(i)[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)])
        for i in range(tensors(gib))
    }
    directory = os.path.join(step, f"rank-{rank}-of-{world}")
    os.makedirs(directory, exist_ok=True)
    dcp.save(state, storage_writer=DeterministicWriter(directory, files=8, threads=8, sync_files=False), no_dist=True)
    dist.destroy_process_group()


def timed_loads(step: str, gib: float, device: str) -> dict:
    from mtc_torch.reader import StepReader

    count, seconds = tensors(gib), []
    for _ in range(LOADS):
        state = {f"w{i}": torch.zeros(ROWS, COLS, device=device) for i in range(count)}
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        dcp.load(state, storage_reader=StepReader(step, threads=16), no_dist=True)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    identical = all(torch.equal(state[f"w{i}"].cpu(), values(i)) for i in range(count))
    median = statistics.median(seconds)
    size = count * ROWS * COLS * 4
    return {"seconds": seconds, "median_s": median, "GBps": round(size / median / 1e9, 2), "bit_identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the state's size in GiB")
    parser.add_argument("--tmp", default="/dev/shm/mtc-bench-reshard", help="a directory on tmpfs")
    parser.add_argument("--save", help=argparse.SUPPRESS)  # a torchrun rank's part: the step directory
    args = parser.parse_args()
    if args.save:
        save(args.save, args.gib)
        return
    shutil.rmtree(args.tmp, ignore_errors=True)
    steps = {"same size": os.path.join(args.tmp, "one"), "resharded": os.path.join(args.tmp, "two")}
    for ranks, step in zip((1, 2), steps.values(), strict=True):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        subprocess.run(
            [*torchrun, "-m", "tests.bench.torch_reshard_load", "--gib", str(args.gib), "--save", step], check=True
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"kind": "reshard load", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    result["bytes"] = tensors(args.gib) * ROWS * COLS * 4
    for name, step in steps.items():
        result[name] = timed_loads(step, args.gib, device)
    result["ratio"] = round(result["resharded"]["median_s"] / result["same size"]["median_s"], 3)
    result["goal"] = "<= 1.5"
    result["verdict"] = "met" if result["ratio"] <= 1.5 else "missed"
    print(json.dumps(result))
    shutil.rmtree(args.tmp, ignore_errors=True)
    sys.exit(0 if result["resharded"]["bit_identical"] and result["same size"]["bit_identical"] else 1)


if __name__ == "__main__":
    main()
