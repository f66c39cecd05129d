"""PyTorch checkpointing on one GPU: ours against the hardware's limits and the alternatives users pick, in one run.

Per state size (``--gib``, default 1, 4 and 16 GB; a mixed-precision Adam state of 14 bytes per parameter: bf16
weights, fp32 master weights and both moments, in 64 Mi-parameter layers on the GPU):

- limits: GPU -> host copies into pageable and pinned memory, host -> GPU from pinned, host -> tmpfs writes by 1, 4, 8
  and 16 threads, tmpfs -> pinned reads by 16 threads;
- setups, each saving ``--saves`` times in a row (the first save beside the steady state, the median of the others):
  ours (``mtc_torch.CheckpointManager`` ``save``, ``async_save``, and ``async_save(wait_for_staging=False)`` with
  ``wait_for_staging()``), ``dcp.save`` and ``dcp.async_save`` stock, ``dcp.async_save`` with DCP's pinned
  ``DefaultStager`` and 8 writer threads, and NVRx 0.7.0 ``LocalCheckpointManager`` (stock, on the GPU; async after a
  sync save, as its docs run it);
- for each: blocking (until the trainer may change the state), total (until the step is in the tmpfs), restore into
  zeroed GPU tensors, bit-identity, and the step time of a stand-in trainer (bf16 matmuls) while the background
  part runs against its time alone;
- ratios beside the goals of docs/pytorch.md ("On GPUs"): ours' blocking / (bytes / pinned GPU -> host bandwidth)
  <= 1.2, ours' save and restore >= 10 GB/s, ours' blocking / NVRx's, ours' restore / the best other restore.

Without CUDA it says so, checks the CPU path's save and restore (bit-identical, the state changed right after the
call), and exits 0. Run it with a Python that has torch (and NVRx for its rows):
``python -m tests.bench.torch_gpu --python .venv-nvrx/bin/python --tmp /mnt/ramdisk`` (root mounts a tmpfs there
when it is not one). JSON lines go to ``--out`` too.
"""

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"NODE_RANK": "0", "NNODES": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
GOAL_BLOCKING_RATIO, GOAL_GBPS = 1.2, 10.0


def emit(out: Any, **row: Any) -> None:
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


class Bench:
    """One GPU, one tmpfs directory, one stand-in trainer; the state is rebuilt per size."""

    def __init__(self, torch: Any, tmp: str, step_ms: float, out: Any) -> None:
        self.torch, self.tmp, self.out = torch, tmp, out
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            self.a @ self.a
        torch.cuda.synchronize()
        self.reps = max(1, int(step_ms / 1000 / ((time.perf_counter() - start) / 10)))
        self.step_alone = statistics.median(self.train_step() for _ in range(10))
        self.state: dict[str, Any] = {}

    def train_step(self) -> float:
        start = time.perf_counter()
        for _ in range(self.reps):
            c = self.a @ self.a
        c.sum().item()  # a host sync per step, as loss.item() is
        return time.perf_counter() - start

    def make_state(self, gib: float) -> int:
        torch = self.torch
        self.state = {}
        torch.cuda.empty_cache()
        layer = 64 << 20
        generator = torch.Generator(device="cuda").manual_seed(0)
        model, optim = {}, {}
        for i in range(max(1, int(gib * 2**30 / 14) // layer)):
            master = torch.randn(layer, device="cuda", generator=generator)
            model[f"layer{i}.weight"] = master.to(torch.bfloat16)
            optim[f"layer{i}.master"] = master
            optim[f"layer{i}.exp_avg"] = torch.randn(layer, device="cuda", generator=generator) * 1e-3
            optim[f"layer{i}.exp_avg_sq"] = torch.rand(layer, device="cuda", generator=generator) * 1e-6
        self.state = {"model": model, "optim": optim}
        torch.cuda.synchronize()
        return sum(t.numel() * t.element_size() for part in self.state.values() for t in part.values())

    def zeros(self) -> dict[str, Any]:
        return {part: {k: self.torch.zeros_like(v) for k, v in tensors.items()} for part, tensors in self.state.items()}

    def identical(self, other: dict[str, Any]) -> bool:
        return all(
            self.torch.equal(v, other[part][k].to(v.device))
            for part, tensors in self.state.items()
            for k, v in tensors.items()
        )

    def limits(self, nbytes: int) -> dict[str, float | None]:
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        timed = {}
        for name, run in (
            ("D2H pageable", lambda: src.cpu()),
            ("D2H pinned", lambda: pinned.copy_(src, non_blocking=True)),
            ("H2D pinned", lambda: src.copy_(pinned, non_blocking=True)),
        ):
            run()  # once to warm up
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            timed[name] = gbps(nbytes, time.perf_counter() - start)
        flat = memoryview(pinned.numpy())
        for threads in (1, 4, 8, 16):
            timed[f"tmpfs write, {threads} threads"] = gbps(nbytes, self._files(flat, threads, write=True))
        timed["tmpfs read, 16 threads"] = gbps(nbytes, self._files(flat, 16, write=False))
        for name in os.listdir(self.tmp):
            if name.startswith("limit"):
                os.unlink(os.path.join(self.tmp, name))
        for what, value in timed.items():
            emit(self.out, kind="limit", what=what, GBps=value, bytes=nbytes)
        return timed

    def _files(self, flat: memoryview, threads: int, write: bool) -> float:
        part = len(flat) // threads

        def one(i: int) -> None:
            path = os.path.join(self.tmp, f"limit{i}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY, 0o600)
            try:
                view, done = flat[i * part : (i + 1) * part], 0
                while done < len(view):
                    done += (
                        os.pwrite(fd, view[done : done + (1 << 30)], done)
                        if write
                        else os.preadv(fd, [view[done : done + (1 << 30)]], done)
                    )
            finally:
                os.close(fd)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(threads)))
        return time.perf_counter() - start

    def run_setup(
        self,
        name: str,
        nbytes: int,
        save: Callable[[str, int], Any],
        restore: Callable[[str, dict[str, Any]], None],
        saves: int,
    ) -> list[dict[str, Any]]:
        """``save(directory, index)`` returns None (done), or something with ``done()``/``result()``."""
        rows = []
        for index in range(saves):
            directory = os.path.join(self.tmp, "setup")
            shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory)
            self.torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                pending = save(directory, index)
                blocking = time.perf_counter() - start
                during = []
                if pending is not None:
                    while not pending.done() and time.perf_counter() - start < 600:
                        during.append(self.train_step())
                    pending.result()
                total = time.perf_counter() - start
                target = self.zeros()
                self.torch.cuda.synchronize()
                start = time.perf_counter()
                restore(directory, target)
                self.torch.cuda.synchronize()
                restore_s = time.perf_counter() - start
                row = dict(
                    kind="setup",
                    setup=name,
                    save=index + 1,
                    bytes=nbytes,
                    blocking_s=round(blocking, 3),
                    total_s=round(total, 3),
                    save_GBps=gbps(nbytes, total),
                    restore_s=round(restore_s, 3),
                    restore_GBps=gbps(nbytes, restore_s),
                    bit_identical=self.identical(target),
                    step_ratio_during=round(statistics.median(during) / self.step_alone, 3) if during else None,
                )
                del target
            except Exception as error:  # a setup that fails is reported, the others still run
                row = dict(
                    kind="setup", setup=name, save=index + 1, bytes=nbytes, error=f"{type(error).__name__}: {error}"
                )
            emit(self.out, **row)
            rows.append(row)
            self.torch.cuda.empty_cache()
        return rows


def setups(
    bench: Bench, managers: list[Any]
) -> dict[str, tuple[Callable[[str, int], Any], Callable[[str, dict[str, Any]], None]]]:
    """Each setup's save and restore, by name; our managers go to ``managers``, for the caller to close."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from mtc_torch import CheckpointManager
    from mtc_torch.manager import default_io_threads
    from mtc_torch.reader import StepReader

    def ours(kind: str) -> tuple[Callable[[str, int], Any], Callable[[str, dict[str, Any]], None]]:
        """One manager for every save of the setup, as a job keeps one: its staging buffers are pinned once."""
        saved = []

        def save(directory: str, index: int) -> Any:
            # ``directory`` is the manager's local directory, emptied before each save outside the timings; the
            # manager is made at the setup's first save and closed after its last: one setup's buffers pinned.
            if not saved:
                managers.append(CheckpointManager(directory, job_name="bench", backup_interval_steps=1000, env=ENV))
            manager = managers[-1]
            saved.append(index + 1)
            if kind == "save":
                manager.save(bench.state, index + 1)
                return None
            future = manager.async_save(bench.state, index + 1, wait_for_staging=kind == "async")
            if kind == "queued":
                manager.wait_for_staging()
            return future

        def restore(directory: str, target: dict[str, Any]) -> None:
            step = os.path.join(directory, str(saved[-1]), "rank-0-of-1")
            dcp.load(target, storage_reader=StepReader(step, threads=default_io_threads(1)), no_dist=True)

        return save, restore

    def stock_save(directory: str, index: int) -> None:
        dcp.save(bench.state, storage_writer=FileSystemWriter(directory), no_dist=True)

    def stock_async_save(directory: str, index: int) -> Any:
        return dcp.async_save(bench.state, storage_writer=FileSystemWriter(directory), no_dist=True)

    def stock_restore(directory: str, target: dict[str, Any]) -> None:
        dcp.load(target, storage_reader=FileSystemReader(directory), no_dist=True)

    def pinned_stager(directory: str, index: int) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        response = dcp.async_save(
            bench.state,
            storage_writer=FileSystemWriter(directory, thread_count=8),
            no_dist=True,
            async_stager=DefaultStager(StagingOptions(True, False, True, True)),
        )
        return response.upload_completion

    table = {
        "ours save": ours("save"),
        "ours async_save": ours("async"),
        "ours async_save, wait_for_staging()": ours("queued"),
        "dcp.save stock": (stock_save, stock_restore),
        "dcp.async_save stock": (stock_async_save, stock_restore),
        "dcp.async_save, pinned DefaultStager, 8 threads": (pinned_stager, stock_restore),
    }
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        table.update(nvrx_setups(bench))
    return table


def nvrx_setups(bench: Bench) -> dict[str, tuple[Callable[[str, int], Any], Callable[[str, dict[str, Any]], None]]]:
    """NVRx 0.7.0's local checkpointing, stock: ``LocalCheckpointManager`` with a ``BasicTensorAwareStateDict``.

    It needs a process group (its replication helpers ask for the rank): one of one rank, on gloo, as a job has.
    """
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    if not dist.is_initialized():
        group_file = os.path.join(bench.tmp, "nvrx-group")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(group_file)  # a file left by another run would hold its rendezvous
        dist.init_process_group("gloo", init_method=f"file://{group_file}", rank=0, world_size=1)

    def state() -> BasicTensorAwareStateDict:
        return BasicTensorAwareStateDict({part: dict(tensors) for part, tensors in bench.state.items()})

    def restore(directory: str, target: dict[str, Any]) -> None:
        manager = LocalCheckpointManager(directory, session_id="bench")
        manager.find_latest()
        loaded, _ = manager.load()
        loaded = loaded.state_dict if hasattr(loaded, "state_dict") else loaded
        for part, tensors in loaded.items():
            for key, value in tensors.items():
                target[part][key].copy_(value)

    def sync(directory: str, index: int) -> None:
        LocalCheckpointManager(directory, session_id="bench").save(state(), index + 1)

    class Async:
        def __init__(self, directory: str, index: int) -> None:
            request = LocalCheckpointManager(directory, session_id="bench").save(state(), index + 1, is_async=True)
            self.queue = AsyncCallsQueue()
            self.queue.schedule_async_request(request)

        def done(self) -> bool:
            self.queue.maybe_finalize_async_calls(blocking=False)
            return self.queue.get_num_unfinalized_calls() == 0

        def result(self) -> None:
            self.queue.maybe_finalize_async_calls(blocking=True)
            self.queue.close()

    return {"NVRx 0.7.0 sync": (sync, restore), "NVRx 0.7.0 async": (Async, restore)}


def report(out: Any, nbytes: int, limits: dict[str, float | None], results: dict[str, list[dict[str, Any]]]) -> None:
    """The steady-state ratios beside their goals (medians of saves 2 on; save 1 printed beside)."""

    def steady(name: str, key: str) -> float | None:
        rows = [r for r in results.get(name, []) if "error" not in r]
        values = [r[key] for r in rows[1:]] or [r[key] for r in rows]
        return statistics.median(values) if values and None not in values else None

    d2h = limits.get("D2H pinned")
    copy_s = nbytes / (d2h * 1e9) if d2h else None
    blocking = steady("ours async_save", "blocking_s")
    nvrx = steady("NVRx 0.7.0 async", "blocking_s")
    save_gbps = steady("ours async_save", "save_GBps")
    restore = steady("ours async_save", "restore_GBps")
    others = [steady(name, "restore_GBps") for name in results if not name.startswith("ours")]
    best = max((o for o in others if o is not None), default=None)

    def line(what: str, value: float | None, goal: str, met: bool | None) -> None:
        verdict = "n/a" if met is None else ("met" if met else "MISSED")
        emit(
            out,
            kind="ratio",
            bytes=nbytes,
            what=what,
            value=None if value is None else round(value, 3),
            goal=goal,
            verdict=verdict,
        )

    ratio = blocking / copy_s if blocking is not None and copy_s else None
    line(
        "ours blocking / (bytes / pinned D2H)",
        ratio,
        f"<= {GOAL_BLOCKING_RATIO}",
        None if ratio is None else ratio <= GOAL_BLOCKING_RATIO,
    )
    line("ours blocking / NVRx async blocking", blocking / nvrx if blocking and nvrx else None, "<= 1 (reported)", None)
    line(
        "ours save GB/s (to the tmpfs)",
        save_gbps,
        f">= {GOAL_GBPS}",
        None if save_gbps is None else save_gbps >= GOAL_GBPS,
    )
    line("ours restore GB/s", restore, f">= {GOAL_GBPS}", None if restore is None else restore >= GOAL_GBPS)
    line("ours restore / best other restore", restore / best if restore and best else None, "reported", None)
    first = [r for r in results.get("ours async_save", [])[:1] if "error" not in r]
    if first:
        emit(
            out,
            kind="first save",
            bytes=nbytes,
            setup="ours async_save",
            blocking_s=first[0]["blocking_s"],
            total_s=first[0]["total_s"],
            note="pins the staging buffers once; not in the ratios above",
        )


def staging_checks(torch: Any, tmp: str, out: Any, device: str) -> bool:
    """Each way a trainer may change the state after a save, on ``device``: the checkpoint holds the values from before.

    - ``async_save`` returns, then the state changes at once;
    - ``async_save(wait_for_staging=False)``, ``wait_for_staging()``, then the state changes;
    - the same with ``pinned_memory_limit_bytes=0`` (the pageable fallback).
    Before each save a change is queued on the GPU's stream, which the checkpoint must hold (the copy runs after it).
    The restore is the parallel reader's. Returns whether every checkpoint held the values from before.
    """
    import torch.distributed.checkpoint as dcp

    from mtc_torch import CheckpointManager
    from mtc_torch.reader import StepReader

    failed = []
    for pattern, limit in (("wait_for_staging=True", None), ("wait_for_staging()", None), ("wait_for_staging()", 0)):
        directory = os.path.join(tmp, "staging-check")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        state = {"w": torch.randn(16 << 20, device=device), "b": torch.randn(1000, device=device).to(torch.bfloat16)}
        with CheckpointManager(
            directory,
            job_name="bench",
            backup_interval_steps=1000,
            env=ENV,
            io_threads=4,
            pinned_memory_limit_bytes=limit,
        ) as manager:
            for value in state.values():
                value.add_(1)  # queued before the save: the checkpoint must hold it
            before = {k: v.clone() for k, v in state.items()}
            future = manager.async_save(state, 1, wait_for_staging=pattern == "wait_for_staging=True")
            if pattern == "wait_for_staging()":
                manager.wait_for_staging()
            for value in state.values():
                value.mul_(-1)
            future.result()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = StepReader(os.path.join(directory, "1", "rank-0-of-1"), threads=4)
        dcp.load(target, storage_reader=reader, no_dist=True)
        identical = all(torch.equal(target[k], before[k]) for k in state)
        shutil.rmtree(directory, ignore_errors=True)
        emit(out, kind="staging check", device=device, pattern=pattern, pinned_limit=limit, bit_identical=identical)
        failed += [] if identical else [pattern]
    return not failed


def run(args: argparse.Namespace) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.makedirs(args.tmp, exist_ok=True)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(args.out, "a")) if args.out else None
        emit(
            out,
            kind="env",
            torch=torch.__version__,
            cuda=torch.version.cuda,
            cpus=os.cpu_count(),
            gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        )
        if not torch.cuda.is_available():
            print("no CUDA here: the GPU rows need a GPU (docs/pytorch.md, 'On GPUs'); checking the CPU path only")
            if not staging_checks(torch, args.tmp, out, "cpu"):
                sys.exit(1)
            return
        staged_right = staging_checks(torch, args.tmp, out, "cuda")
        bench = Bench(torch, args.tmp, args.step_ms, out)
        emit(out, kind="trainer", step_ms=round(bench.step_alone * 1000, 2))
        for gib in (float(g) for g in args.gib.split(",")):
            nbytes = bench.make_state(gib)
            limits = bench.limits(min(nbytes, 8 << 30))
            managers: list[Any] = []
            results = {}
            for name, (save, restore) in setups(bench, managers).items():
                if args.only and not any(word in name for word in args.only.split(",")):
                    continue
                saves = args.saves if name.startswith("ours") else args.other_saves or args.saves
                results[name] = bench.run_setup(name, nbytes, save, restore, saves)
                while managers:
                    managers.pop().close()  # frees its pinned buffers before the next setup
            report(out, nbytes, limits, results)
    if not staged_right:
        sys.exit("a checkpoint did not hold the values from before the state changed (the staging checks above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="a Python with torch (and NVRx): used when this one has no torch")
    parser.add_argument("--gib", default="1,4,16", help="state sizes in GiB, comma-separated")
    parser.add_argument("--tmp", default="/dev/shm/mtc-bench-torch-gpu", help="a directory on tmpfs")
    parser.add_argument("--saves", type=int, default=3, help="saves per setup of ours (the first is reported apart)")
    parser.add_argument("--other-saves", type=int, default=0, help="saves per other setup (0: as --saves)")
    parser.add_argument("--step-ms", type=float, default=200.0, help="the stand-in training step, in ms")
    parser.add_argument("--only", default="", help="setups whose names contain any of these words")
    parser.add_argument("--out", default="", help="append the JSON lines to this file too")
    args = parser.parse_args()
    if importlib.util.find_spec("torch") is None:
        if not args.python:
            sys.exit("no torch in this Python: pass --python .venv-nvrx/bin/python (make bench builds it)")
        env = {**os.environ, "PYTHONPATH": ROOT}
        sys.exit(
            subprocess.run([args.python, "-m", "tests.bench.torch_gpu", *sys.argv[1:]], env=env, cwd=ROOT).returncode
        )
    run(args)


if __name__ == "__main__":
    main()
