"""The goodput bench's checkpoint-interval model (tests/bench/goodput_model.py) against hand computations."""

import json

import pytest

from tests.bench.goodput_model import (
    ASSUMED,
    GPUS_PER_HOST,
    HOST_MEM_BW,
    STORE_BW,
    TARGET_BYTES,
    Costs,
    goodput,
    interval,
    save_interval_steps,
    scaled,
    scaled_bandwidth,
    torch_gpu_rates,
    young_daly_interval,
)


def test_young_daly_interval_is_sqrt_of_twice_blocking_times_mtbf():
    assert young_daly_interval(3.0, 600.0) == pytest.approx(60.0)  # sqrt(2 * 3 * 600) = sqrt(3600)
    assert interval(Costs(blocking=3.0, restart=0.0, min_interval=100.0), 600.0) == 100.0  # an upload must finish first


def test_goodput_at_a_given_interval_matches_the_hand_computation():
    # A 50 s cycle (48 s of training, 2 s blocked): 0.96 useful. A failure costs 10 s of restart and half a cycle
    # (25 s) of lost work, 35 s every 600 s: 1 - 35/600. So 0.96 * 565/600 = 0.904.
    assert goodput(Costs(blocking=2.0, restart=10.0), 600.0, interval_s=48.0) == pytest.approx(0.904)


def test_goodput_defaults_to_the_young_daly_interval_and_is_never_negative():
    costs = Costs(blocking=3.0, restart=0.0)
    # interval 60 s, cycle 63 s: 60/63 * (1 - 31.5/600)
    assert goodput(costs, 600.0) == pytest.approx(60 / 63 * (1 - 31.5 / 600))
    assert goodput(costs, 600.0) > goodput(costs, 600.0, interval_s=30.0)
    assert goodput(Costs(blocking=1.0, restart=700.0), 600.0) == 0.0


def test_scaled_costs_add_the_extra_bytes_at_the_stated_bandwidths():
    # 100 MB measured, 10 GB target: 9.9 GB more, copied at 9.9 GB/s (+1 s blocked) and read at 1 GB/s (+9.9 s);
    # the whole 10 GB uploaded at 2 GB/s takes 5 s.
    measured = Costs(blocking=0.1, restart=20.0)
    target = scaled(measured, 1e8, 1e10, copy_bandwidth=9.9e9, restore_bandwidth=1e9, upload_bandwidth=2e9)
    assert target == Costs(blocking=pytest.approx(1.1), restart=pytest.approx(29.9), min_interval=pytest.approx(5.0))
    assert scaled(measured, 1e8, 1e10, copy_bandwidth=9.9e9, restore_bandwidth=1e9).min_interval == 0.0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="mtbf"):
        young_daly_interval(1.0, 0.0)
    with pytest.raises(ValueError, match="positive"):
        goodput(Costs(blocking=1.0, restart=1.0), 600.0, interval_s=0.0)


def test_torch_gpu_rates_take_the_steady_state_at_the_largest_size_per_host():
    row = {"kind": "setup", "setup": "ours async_save", "bytes": 16e9}
    lines = [
        json.dumps(r)
        for r in (
            {"kind": "limit", "what": "D2H pinned", "GBps": 55.0},
            {**row, "save": 1, "blocking_s": 9.0, "restore_GBps": 1.0},  # the first save: pins its buffers
            {**row, "save": 2, "blocking_s": 0.4, "restore_GBps": 12.0},
            {**row, "save": 3, "blocking_s": 0.2, "restore_GBps": 14.0},
            {**row, "save": 2, "bytes": 1e9, "blocking_s": 0.001, "restore_GBps": 50.0},  # a smaller state
            {**row, "save": 3, "error": "RuntimeError: x"},
        )
    ]
    rates = torch_gpu_rates(lines, cap=1e15)
    assert rates.copy == pytest.approx(GPUS_PER_HOST * 16e9 / 0.3)
    assert rates.restore == pytest.approx(GPUS_PER_HOST * 13e9)
    assert "16.0 GB" in rates.source
    # 8 x 53.3 GB/s out and 8 x 13 GB/s in: the copy out is more than the host's memory takes
    capped = torch_gpu_rates(lines)
    assert (capped.copy, capped.restore) == (HOST_MEM_BW, pytest.approx(GPUS_PER_HOST * 13e9))
    with pytest.raises(ValueError, match="no steady-state row"):
        torch_gpu_rates(lines[:2])


def test_without_gpu_results_the_rates_are_the_probes_and_say_so():
    # 8 x 55.2 GB/s = 441.6 GB/s out, capped at the host's 300; the RAM read of 25.49 GB/s is under the cap.
    assert (ASSUMED.copy, ASSUMED.restore) == (HOST_MEM_BW, pytest.approx(25.49e9))
    assert ASSUMED.source.startswith("assumed") and "55.2 GB/s" in ASSUMED.source


def test_save_interval_steps_is_young_daly_in_steps_bounded_by_the_upload():
    # sqrt(2 * 0.25 * 32) = 4 s: 13.3 steps of 0.3 s, rounded to 13; an upload of 21 s needs 70 steps
    assert save_interval_steps(0.25, 32.0, 0.3) == 13
    assert save_interval_steps(0.25, 32.0, 0.3, upload_s=21.0) == 70
    assert save_interval_steps(0.0, 32.0, 0.3) == 1
    with pytest.raises(ValueError, match="step_s"):
        save_interval_steps(0.25, 32.0, 0.0)


def test_scaled_bandwidth_keeps_a_full_transfer_as_long_as_the_real_one():
    bench_bytes = 64 * 2**20
    rate = scaled_bandwidth(STORE_BW, bench_bytes)
    assert bench_bytes / rate == pytest.approx(TARGET_BYTES / STORE_BW)  # 21 s
    assert rate == pytest.approx(3.196e6, rel=1e-3)  # about 3 MiB/s, as the issue reckons
