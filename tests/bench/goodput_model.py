"""The checkpoint-interval model the goodput bench prints beside its measurements (``tests/bench/goodput.py``).

A job saves every ``interval`` seconds of training, each save blocking training ``blocking`` seconds; failures
come every ``mtbf`` seconds on average; each costs the restart (failure to the first step after it, lost work
excluded) plus on average half a save cycle of lost work. Then, to first order (Young 1974, "A first order
approximation to the optimum checkpoint interval", CACM 17(9); Daly 2006, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3)):

    goodput = interval / (interval + blocking) * (1 - (restart + (interval + blocking) / 2) / mtbf)

and the interval that maximizes it is about ``sqrt(2 * blocking * mtbf)`` (Young's; Daly's first-order term).
A tier that finishes a save in the background (an upload) cannot save again before it is done: the interval is
at least ``min_interval``.

Where the figures come from (printed by the benches with them):
- TARGET_BYTES: the seed's example (``001``): a 70B model, 12 bytes a parameter, on 32 hosts: 26.25 GB per host.
- STORE_BW, NEAR_BW: stated, not measured: an object store at 10 Gbit/s per host (1.25 GB/s, each way), a peer or
  the node's RAM at 40 Gbit/s (5 GB/s).
- The accelerator copies: from ``tests/bench/torch_gpu.py``'s results (``torch_gpu_rates``; the benches read
  GPU_RESULTS, one H200's run, unless told otherwise), else ``ASSUMED``: one H200's pinned copy out of GPU memory as the GPU probe measured it
  (``../shared/gpu/2026-11-26-h200-run1.jsonl``, "D2H pinned": 55.2 GB/s), times GPUS_PER_HOST, and a restore
  from the node's RAM at the same probe's tmpfs -> pinned read on 16 threads (25.5 GB/s for its host); per-host
  rates no faster than HOST_MEM_BW.
"""

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Iterable

# What the benches model: the seed's 70B on 32 hosts (001: 26.25 GB per host), a failure every 10 minutes, and stated
# bandwidths per host, bytes/s: the object store (each way), the node's RAM or a peer.
TARGET_BYTES, MTBF_S = 26.25e9, 600.0
STORE_BW, NEAR_BW = 1.25e9, 5e9
SOURCES = (
    f"{TARGET_BYTES / 1e9:.2f} GB/host: the seed's 70B on 32 hosts (seed 001); store {STORE_BW / 1e9:.2f} GB/s "
    f"and peer {NEAR_BW / 1e9:.0f} GB/s per host: stated in tests/bench/goodput_model.py"
)
# A GPU host's accelerators, each copying over its own PCIe link: per-GPU rates times this are per-host rates.
GPUS_PER_HOST = 8
# Every copy in or out of a host's accelerators crosses its memory: per-host rates are capped at this. Stated: about
# half the 614 GB/s peak of an 8-GPU host's two sockets of 8 DDR5-4800 channels, as a sustained DMA rate.
HOST_MEM_BW = 300e9
# The GPU probe's figures (one H200, ../shared/gpu/2026-11-26-h200-run1.jsonl): the pinned copy out of one GPU's
# memory, and the host's tmpfs -> pinned read on 16 threads.
PROBE_D2H_PER_GPU, PROBE_RAM_READ = 55.2e9, 25.49e9
# torch_gpu's output on one H200 (docs/benchmarks.md, "PyTorch on one GPU"): the rates the benches model by default.
GPU_RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "docs",
    "results",
    "2026-11-27-h200-torch_gpu.jsonl",
)
# The model as the benches print it beside their figures.
FORMULA = "goodput = τ/(τ+δ) × (1 − (R + (τ+δ)/2)/MTBF), τ = max(sqrt(2δ·MTBF), upload time) (Young 1974, Daly 2006)"


@dataclasses.dataclass(frozen=True)
class Costs:
    """One setup's checkpoint costs at one checkpoint size, in seconds.

    Attributes:
      blocking: training time blocked per save.
      restart: from a failure to the first training step after it, lost work excluded.
      min_interval: the shortest save interval the setup sustains (0: any).
    """

    blocking: float
    restart: float
    min_interval: float = 0.0


def young_daly_interval(blocking: float, mtbf: float) -> float:
    """The optimum save interval, ``sqrt(2 * blocking * mtbf)`` seconds (Young 1974, Daly 2006 first order).

    Raises:
      ValueError: ``blocking`` is negative or ``mtbf`` is not positive.
    """
    if blocking < 0 or mtbf <= 0:
        raise ValueError(f"blocking must be >= 0 and mtbf > 0, got {blocking} and {mtbf}")
    return math.sqrt(2 * blocking * mtbf)


def interval(costs: Costs, mtbf: float) -> float:
    """The interval the model uses: Young/Daly's, but no shorter than ``costs.min_interval`` (seconds)."""
    return max(young_daly_interval(costs.blocking, mtbf), costs.min_interval)


def goodput(costs: Costs, mtbf: float, interval_s: float | None = None) -> float:
    """The share of wall time that makes progress, in [0, 1], at a save every ``interval_s`` seconds of training
    (default: ``interval(costs, mtbf)``) and a failure every ``mtbf`` seconds.

    Raises:
      ValueError: ``mtbf`` or the interval is not positive.
    """
    tau = interval(costs, mtbf) if interval_s is None else interval_s
    if tau <= 0 or mtbf <= 0:
        raise ValueError(f"the interval and mtbf must be positive, got {tau} and {mtbf}")
    cycle = tau + costs.blocking
    return max(0.0, tau / cycle * (1 - (costs.restart + cycle / 2) / mtbf))


def save_interval_steps(blocking: float, mtbf: float, step_s: float, upload_s: float = 0.0) -> int:
    """A job's save interval in steps of ``step_s`` seconds: Young/Daly's from its ``blocking`` per save and a failure
    every ``mtbf`` seconds of training, but no shorter than ``upload_s`` (a background upload must end before the
    next save starts); at least 1.

    Raises:
      ValueError: ``step_s`` is not positive (or as ``young_daly_interval``).
    """
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    return max(1, round(young_daly_interval(blocking, mtbf) / step_s), math.ceil(upload_s / step_s))


def scaled_bandwidth(bandwidth: float, bytes_per_host: float) -> float:
    """``bandwidth`` (bytes/s per host, at TARGET_BYTES per host) for a bench of ``bytes_per_host``: the rate at which
    a full save or restore of the bench's bytes takes as long as the real one (e.g. 21 s for STORE_BW)."""
    return bandwidth * bytes_per_host / TARGET_BYTES


def scaled(
    measured: Costs,
    measured_bytes: float,
    target_bytes: float,
    copy_bandwidth: float,
    restore_bandwidth: float,
    upload_bandwidth: float | None = None,
) -> Costs:
    """``measured`` (at ``measured_bytes`` per host) carried to ``target_bytes`` per host; bandwidths in bytes/s per host.

    What was measured is kept as a fixed cost (at small sizes it is mostly that: barriers, metadata, start-up), and
    the extra bytes are added at the stated bandwidths: a save blocks training while it copies them out of the
    training state (``copy_bandwidth``; the rest of an async save runs in the background), a restart reads them
    from the tier it restores from (``restore_bandwidth``). With ``upload_bandwidth`` (a background upload), a save
    takes ``target_bytes / upload_bandwidth`` to finish: the shortest save interval.
    """
    extra = max(0.0, target_bytes - measured_bytes)
    return Costs(
        blocking=measured.blocking + extra / copy_bandwidth,
        restart=measured.restart + extra / restore_bandwidth,
        min_interval=target_bytes / upload_bandwidth if upload_bandwidth else 0.0,
    )


@dataclasses.dataclass(frozen=True)
class Rates:
    """Per-host bandwidths of the accelerator path, bytes/s, and where they come from.

    Attributes:
      copy: out of accelerator memory while a save blocks training.
      restore: into accelerator memory from the node's RAM (a restore from a peer is also bounded by NEAR_BW).
      source: ``assumed``, or the measurement they were read from.
    """

    copy: float
    restore: float
    source: str


ASSUMED = Rates(
    min(GPUS_PER_HOST * PROBE_D2H_PER_GPU, HOST_MEM_BW),
    min(PROBE_RAM_READ, HOST_MEM_BW),
    f"assumed (no torch_gpu results): the H200 probe's pinned copy out, {PROBE_D2H_PER_GPU / 1e9:.1f} GB/s x "
    f"{GPUS_PER_HOST} GPUs, capped at {HOST_MEM_BW / 1e9:.0f} GB/s host memory; restore at its tmpfs -> pinned read, "
    f"{PROBE_RAM_READ / 1e9:.1f} GB/s per host",
)


def torch_gpu_rates(lines: Iterable[str], setup: str = "ours async_save", cap: float = HOST_MEM_BW) -> Rates:
    """Per-host rates from ``tests/bench/torch_gpu.py``'s JSON lines: at the largest state it measured, the state's
    bytes over ``setup``'s median blocking seconds, and its median restore rate, over the saves after the first (the
    steady state), each times GPUS_PER_HOST and no faster than ``cap`` (the host's memory).

    Raises:
      ValueError: the lines hold no error-free steady-state row of ``setup``.
    """
    rows = [
        row
        for row in map(json.loads, filter(str.strip, lines))
        if row.get("kind") == "setup" and row.get("setup") == setup and row.get("save", 1) > 1 and "error" not in row
    ]
    if not rows:
        raise ValueError(f"no steady-state row of {setup!r} (a save after the first, without an error)")
    largest = max(row["bytes"] for row in rows)
    rows = [row for row in rows if row["bytes"] == largest]
    blocking = statistics.median(row["blocking_s"] for row in rows)
    restore = statistics.median(row["restore_GBps"] for row in rows) * 1e9
    return Rates(
        copy=min(GPUS_PER_HOST * largest / blocking if blocking > 0 else math.inf, cap),
        restore=min(GPUS_PER_HOST * restore, cap),
        source=f"torch_gpu, {setup}, {largest / 1e9:.1f} GB per GPU, x{GPUS_PER_HOST} GPUs, capped at {cap / 1e9:.0f} GB/s",
    )
