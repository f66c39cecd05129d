"""The goodput bench's own arithmetic (tests/bench/goodput.py): the bytes a node uploads per save, each setup's
intervals, a stall told from a blocked save, and what the model adds to a measured restart."""

import dataclasses

import pytest

from tests.bench import goodput
from tests.bench.goodput import Calibration, Figures, Incarnation, Intervals, Run
from tests.bench.goodput_model import NEAR_BW, STORE_BW, TARGET_BYTES
from tests.bench.goodput_regime import LOOPBACK, Regime

MIB = 2**20


def test_node_upload_bytes_is_the_busiest_nodes_share_of_one_step_plus_its_metadata():
    orbax = [
        ("5/state/ocdbt.process_0/d/a", 20 * MIB),
        ("5/state/ocdbt.process_1/d/b", 28 * MIB),
        ("5/state/manifest.ocdbt", MIB),  # no node's: counted with the busiest
        ("10/state/ocdbt.process_1/d/c", 4 * MIB),  # an unfinished step
        (".created", 0),
    ]
    assert goodput.node_upload_bytes(orbax) == 29 * MIB
    ours = [
        ("default/job/steps/40/rank-0/state/x", 30 * MIB),
        ("default/job/steps/40/rank-0.manifest.json", 1000),
        ("default/job/steps/40-t1/rank-2/state/x", 31 * MIB),
        ("default/job/steps/40/COMMIT", 100),
    ]
    assert goodput.node_upload_bytes(ours) == 31 * MIB + 100  # the COMMIT of step 40 (either timeline)
    assert goodput.node_upload_bytes([]) == 0


def test_each_setup_saves_at_young_daly_and_uploads_no_faster_than_its_link_or_its_calibration():
    calibration = Calibration(
        0.3, {"persistent": 0.25, "ours": 0.25}, {"persistent": 28 * MIB, "ours": 64 * MIB}, {"ours": 6.0}
    )
    realistic = Regime.realistic(64 * MIB)

    def steps(name, regime, calibrated=calibration):
        found = goodput.intervals_for(name, calibrated, regime, 32.0)
        return found.save, found.store

    # sqrt(2 * 0.25 * 32) = 4 s = 13 steps; 28 MiB at 64 MiB per 21 s takes 9.2 s = 31 steps; 64 MiB 21 s = 70
    assert steps("persistent", realistic) == (31, 31)
    assert steps("ours", realistic) == (13, 70)
    # Unlimited: Young/Daly's, but no shorter than the calibrated upload: ours' 6 s is 20 steps
    assert steps("persistent", LOOPBACK) == (13, 13)
    assert steps("ours", LOOPBACK) == (13, 20)
    assert "as calibrated" in goodput.intervals_for("ours", calibration, LOOPBACK, 32.0).why
    # counted in fast steps: 6 s at 0.2 s a step is 30
    fast = dataclasses.replace(calibration, fast_step=0.2)
    assert steps("ours", LOOPBACK, fast) == (13, 30)


def test_upload_span_is_the_median_time_of_the_completed_steps():
    objects = [
        ("5/state/ocdbt.process_0/d/a", 100.0),
        ("5/commit_success.txt", 102.0),
        ("10/state/ocdbt.process_0/d/a", 110.0),
        ("10/commit_success.txt", 114.0),
        ("15/state/ocdbt.process_0/d/a", 120.0),  # not completed
        ("x/default/j/steps/20/rank-0/a", 130.0),
        ("x/default/j/steps/20/COMMIT", 136.0),
    ]
    assert goodput.upload_span(objects) == 4.0  # of 2, 4, 6
    assert goodput.upload_span(objects[4:5]) == 0.0


def _incarnation(first: int, last: int, killed_after: float, saves=(), restored=None) -> Incarnation:
    steps = {s: 100.0 + s for s in range(first, last + 1)}
    return Incarnation(restored, steps, set(saves), 100.0 + last + killed_after)


def test_a_stall_inside_a_save_is_not_a_stopped_job_but_a_stall_elsewhere_or_at_the_end_is():
    every = Intervals(10, 30)
    blocked = Run(
        "persistent", [_incarnation(1, 30, 12.0, saves={1}), _incarnation(31, 40, 1.0)], 60.0, intervals=every
    )
    assert not goodput.stopped_training(blocked)
    stuck = Run(
        "emergency", [_incarnation(1, 25, 12.0, saves={10, 20}), _incarnation(26, 40, 1.0)], 60.0, intervals=every
    )
    assert goodput.stopped_training(stuck)
    at_end = Run("emergency", [_incarnation(1, 20, 1.0), _incarnation(21, 21, 25.0)], 60.0, intervals=every)
    assert goodput.stopped_training(at_end)


def test_the_model_adds_what_the_measured_restart_lacks():
    rates = goodput.goodput_model.Rates(copy=300e9, restore=25e9, source="test")
    extra = TARGET_BYTES - goodput.NODE_BYTES
    incs = [_incarnation(1, 10, 0.5), _incarnation(11, 20, 0.5, restored=10), _incarnation(21, 30, 0.5, restored=20)]
    fig = Figures(0.5, 30, [0, 0], [7.0, 9.0], 0.2)
    kinds = ["preemption", "node loss"]
    # Realistic: the reads were measured at the links' speed; only the copy into accelerator memory is added.
    realistic = goodput.modeled(Run("ours", incs, 60.0, regime="realistic", kinds=kinds), fig, rates)
    assert realistic.restart == pytest.approx(8.0 + extra / 25e9)
    assert realistic.blocking == pytest.approx(0.2 + extra / 300e9) and realistic.min_interval == 0.0
    # Loopback: the node loss's read from a peer at NEAR_BW too (the preemption read its own RAM).
    loopback = goodput.modeled(Run("ours", incs, 60.0, regime="loopback", kinds=kinds), fig, rates)
    assert loopback.restart == pytest.approx(statistics_median(7.0, 9.0 + extra / NEAR_BW) + extra / 25e9)
    # Persistent only restored nothing after the first failure: the whole read at STORE_BW, in either regime.
    nothing = [incs[0], _incarnation(11, 20, 0.5), incs[2]]
    persistent = goodput.modeled(Run("persistent", nothing, 60.0, regime="realistic", kinds=kinds), fig, rates)
    assert persistent.restart == pytest.approx(statistics_median(7.0 + TARGET_BYTES / STORE_BW, 9.0) + extra / 25e9)
    assert persistent.min_interval == pytest.approx(TARGET_BYTES / STORE_BW)


def statistics_median(a: float, b: float) -> float:
    return (a + b) / 2


def test_restart_for_goal_is_where_the_model_meets_it():
    costs = goodput.goodput_model.Costs(blocking=0.3, restart=0.0)
    needed = goodput.restart_for_goal(costs)
    at = goodput.goodput_model.goodput(goodput.goodput_model.Costs(blocking=0.3, restart=needed), goodput.MTBF_S)
    assert at == pytest.approx(goodput.GOAL)


def test_the_rpo_verdict_is_the_newest_step_minus_the_newest_backup_against_one_interval_plus_one_upload():
    every = Intervals(10, 52, upload=40)
    incs = [_incarnation(1, 100, 0.5), _incarnation(90, 180, 0.5, restored=89)]
    held = Run("ours", incs, 60.0, intervals=every, backed_up=[(100, None), (180, 90)])
    assert goodput.lag_verdict(held) == ([100, 90], 92, False)  # nothing stored at step 100: the whole step
    held = dataclasses.replace(held, backed_up=[(100, 10), (180, 90)])
    assert goodput.lag_verdict(held) == ([90, 90], 92, True)
    # A run saved before the record (or an interval without an upload): no verdict.
    assert goodput.lag_verdict(dataclasses.replace(held, backed_up=[])) is None
    assert goodput.lag_verdict(dataclasses.replace(held, intervals=Intervals(10, 52))) is None
