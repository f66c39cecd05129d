"""CPU-ONLY SHIM for running the stock TorchTitan 0.3.0 trainer on CPU processes (gloo). A GPU pod
does not need it and must not use it; TorchTitan's source is not edited.

Python imports ``sitecustomize`` at startup from ``sys.path``: the harness puts this directory on the
trainers' ``PYTHONPATH`` and sets ``MTC_TORCHTITAN_CPU_SHIM=1``. Without that variable it does
nothing (and imports nothing), so other programs of the same virtualenv start as usual. It:

- makes torch report ``cpu`` as the available accelerator, so TorchTitan's device module is
  ``torch.cpu`` (stock, it falls back to ``cuda`` and fails without a driver);
- adds the ``torch.cpu`` calls TorchTitan's memory monitor and ``set_device`` path make (device name
  and capacity, memory stats: none), and makes ``current_device()`` an index;
- runs FlexAttention eagerly (stock, it compiles it with Inductor for GPUs), backward included: torch
  refuses a CPU backward only in an up-front check (``_validate_device``), which is skipped;
- makes FSDP reduce gradients with SUM and divide separately (gloo has neither AVG nor PREMUL_SUM
  for reduce-scatter); the gradients are the same values up to float rounding.
"""

import os

if os.environ.get("MTC_TORCHTITAN_CPU_SHIM") == "1" and "LOCAL_RANK" in os.environ:  # torchrun's workers only
    import collections
    import functools
    import inspect

    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"

    _cpu_properties = collections.namedtuple("_CpuProperties", "name total_memory")
    torch.cpu.get_device_name = lambda device=None: "cpu"
    torch.cpu.get_device_properties = lambda device=None: _cpu_properties(
        "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    torch.cpu.memory_stats = lambda device=None: {}
    torch.cpu.reset_peak_memory_stats = lambda device=None: None
    torch.cpu.empty_cache = lambda: None
    torch.cpu.set_device = lambda device: None
    torch.cpu.current_device = lambda: 0  # an index, as barrier(device_ids=[...]) takes (stock: the string "cpu")

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    _divide_factors = _fsdp_collectives._get_gradient_divide_factors
    _divide_signature = inspect.signature(_divide_factors)

    @functools.wraps(_divide_factors)
    def _sum_divide_factors(*args, **kwargs):
        bound = _divide_signature.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True
        return _divide_factors(*bound.args, **bound.kwargs)

    _fsdp_collectives._get_gradient_divide_factors = _sum_divide_factors

    import torch.nn.attention.flex_attention as _flex
    from torchtitan.models.common.attention import FlexAttention

    _flex._validate_device = lambda query, key, value: None
    FlexAttention._compiled_flex_attn = staticmethod(_flex.flex_attention)

if os.environ.get("MTC_TORCHTITAN_LOSS_DIR") and "LOCAL_RANK" in os.environ:
    # TEST OBSERVATION, not a CPU shim: TorchTitan prints a step's loss rounded to 5 digits; the harness compares
    # losses bit for bit, so every process also appends each logged step's loss, in full, to
    # $MTC_TORCHTITAN_LOSS_DIR/loss-rank<RANK>.jsonl (one {"step": N, "loss": X} line each).
    import json as _json

    from torchtitan.components.metrics import MetricsProcessor

    _log_metrics = MetricsProcessor.log
    _loss_path = os.path.join(os.environ["MTC_TORCHTITAN_LOSS_DIR"], f"loss-rank{os.environ.get('RANK', '0')}.jsonl")

    def _log_and_record(self, step, global_avg_loss, *args, **kwargs):
        result = _log_metrics(self, step, global_avg_loss, *args, **kwargs)
        with open(_loss_path, "a", encoding="utf-8") as f:
            f.write(_json.dumps({"step": int(step), "loss": float(global_avg_loss)}) + "\n")
        return result

    MetricsProcessor.log = _log_and_record
