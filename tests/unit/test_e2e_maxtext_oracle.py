"""The oracle of ``make e2e-maxtext`` (tests/drivers/e2e_maxtext.py) on made-up runs: no process, no MaxText.

Issue 21: the killed run's losses stopped at the newest committed step, the restored run's began
after it, the comparison was empty and the harness printed "bit-identical: True". An empty
comparison must be a harness error, and the kill must wait until there is something to compare.
"""

import json
import os

import pytest

from examples.local_cluster import Pod
from tests.drivers.e2e_maxtext import MaxTextJob
from tests.helpers.trainer_oracle import HarnessError, compare_losses, judge, logged_past

COMMITTED = 20
# What MaxText wrote before the kill (its metrics lag a step) and after restoring step 20.
STOPS_AT_COMMIT = {18: 2.51, 19: 2.47, 20: 2.44}
RESTORED = {21: 2.40, 22: 2.38, 23: 2.35}
PAST_COMMIT = {**STOPS_AT_COMMIT, 21: 2.40}


def judged(before, after):
    return judge("1x2", "preemption", COMMITTED, [COMMITTED, COMMITTED], before, after, 12.0, 0.05, {})


def test_a_killed_run_whose_losses_stop_at_the_committed_step_is_a_harness_error_not_a_pass():
    result = judged([STOPS_AT_COMMIT, STOPS_AT_COMMIT], [RESTORED, RESTORED])
    assert result.compared_steps == []
    assert result.harness_error is not None and "nothing compared" in result.harness_error
    assert not result.passed


def test_one_pod_that_compared_nothing_is_a_harness_error_even_when_the_other_compared():
    result = judged([PAST_COMMIT, STOPS_AT_COMMIT], [RESTORED, RESTORED])
    assert result.compared_steps == [21]
    assert "pod 1" in result.harness_error and "pod 0" not in result.harness_error
    assert not result.passed


def test_no_pods_compared_nothing():
    assert compare_losses([], []).harness_error is not None


def test_equal_losses_past_the_commit_pass_and_a_different_one_fails_as_a_difference():
    assert judged([PAST_COMMIT, PAST_COMMIT], [RESTORED, RESTORED]).passed
    different = judged([PAST_COMMIT, {**PAST_COMMIT, 21: 2.4000001}], [RESTORED, RESTORED])
    assert different.harness_error is None and not different.equal_losses and not different.passed


def test_a_restore_of_another_step_fails_with_equal_losses():
    result = judge("1x2", "node loss", COMMITTED, [18, COMMITTED], [PAST_COMMIT] * 2, [RESTORED] * 2, 12.0, 0.05, {})
    assert result.harness_error is None and not result.passed


def test_the_kill_waits_for_a_loss_past_the_newest_step_committed_everywhere():
    assert not logged_past(COMMITTED, [PAST_COMMIT, STOPS_AT_COMMIT])
    assert not logged_past(COMMITTED, [PAST_COMMIT, {}])
    assert logged_past(COMMITTED, [PAST_COMMIT, PAST_COMMIT])


def fake_job(tmp_path, committed: list[list[int]], losses: list[dict[int, float]]) -> MaxTextJob:
    """A MaxText job whose pods have no process: ramdisks with ``committed`` steps (and an
    uncommitted one after them) and metrics files with ``losses``, as MaxText writes them."""
    job = MaxTextJob("maxtext", [], str(tmp_path), [])
    for index, (steps, pod_losses) in enumerate(zip(committed, losses, strict=True)):
        pod = Pod(f"pod-{index}", None, str(tmp_path / f"pod-{index}"), str(tmp_path / f"pod-{index}.log"))
        for step in steps:
            os.makedirs(os.path.join(pod.target, str(step)))
        os.makedirs(os.path.join(pod.target, f"{max(steps) + 2}.orbax-checkpoint-tmp"))
        with open(job.metrics_path(pod), "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": s, "learning/loss": loss}) + "\n" for s, loss in pod_losses.items())
            f.write('{"step": 99, "learning/lo')  # a line still being written is not a logged loss
        job.pods.append(pod)
    return job


def test_the_kill_gives_up_with_a_harness_error_when_no_loss_past_the_commit_comes(tmp_path):
    # Both pods committed step 20 (and began saving 22); pod 1 logged no loss after step 20.
    job = fake_job(tmp_path, [[18, 20], [18, 20]], [PAST_COMMIT, STOPS_AT_COMMIT])
    with pytest.raises(HarnessError, match="newest commit was step 20"):
        job.kill_past_newest_commit(timeout=0.3)


def test_the_kill_waits_while_a_pod_committed_a_newer_step_than_the_others(tmp_path):
    # Pod 1's step 20 would be replicated before its step 18: step 18, the one complete everywhere,
    # might never get a copy off pod 1's node.
    job = fake_job(tmp_path, [[18], [18, 20]], [PAST_COMMIT, PAST_COMMIT])
    with pytest.raises(HarnessError, match=r"newest commit was step 18 .*commits \[18, 20\]"):
        job.kill_past_newest_commit(timeout=0.3)


def test_the_kill_returns_the_newest_step_committed_everywhere_and_the_losses_it_read(tmp_path):
    job = fake_job(tmp_path, [[18, 20], [18, 20]], [PAST_COMMIT, {**PAST_COMMIT, 22: 2.3}])
    assert job.kill_past_newest_commit(timeout=0.3) == (20, [PAST_COMMIT, {**PAST_COMMIT, 22: 2.3}])
