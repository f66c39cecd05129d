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
"""

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable

# What the benches model: the seed's 70B on 32 hosts (001: 26.25 GB per host), a failure every 10 minutes, and stated
# bandwidths per host, bytes/s: the object store, the node's RAM or a peer, the copy out of accelerator memory.
TARGET_BYTES, MTBF_S = 26.25e9, 600.0
STORE_BW, NEAR_BW, COPY_BW = 1.25e9, 5e9, 25e9
# A GPU host's accelerators, each copying over its own PCIe link: per-GPU rates times this are per-host rates.
GPUS_PER_HOST = 8
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


ASSUMED = Rates(COPY_BW, NEAR_BW, "assumed")


def torch_gpu_rates(lines: Iterable[str], setup: str = "ours async_save") -> Rates:
    """Per-host rates from ``tests/bench/torch_gpu.py``'s JSON lines: at the largest state it measured, the state's
    bytes over ``setup``'s median blocking seconds, and its median restore rate, over the saves after the first (the
    steady state), each times GPUS_PER_HOST.

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
        copy=GPUS_PER_HOST * largest / blocking if blocking > 0 else math.inf,
        restore=GPUS_PER_HOST * restore,
        source=f"torch_gpu, {setup}, {largest / 1e9:.1f} GB per GPU, x{GPUS_PER_HOST} GPUs",
    )
