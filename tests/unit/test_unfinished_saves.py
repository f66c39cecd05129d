"""A new pod's publish removes the saves its predecessor never committed: a pod killed mid-save leaves up to a
whole shard that no process will ever finish, and a ramdisk sized by the rule has no room for it (CI caught a
job meeting ENOSPC after a restore on a ramdisk of exactly the rule, with one such leftover)."""

import os

import pytest

from replicator.local_tier import frameworks


@pytest.mark.parametrize(
    ("framework", "unfinished", "kept"),
    [
        (
            "orbax",
            ["32.orbax-checkpoint-tmp", "33.orbax-checkpoint-tmp-1764048000"],
            ["31", "notes.orbax-checkpoint-tmp", "7.tmp"],
        ),
        # NeMo's save of global step 33 (committed as 32 by a rename it never made) and its unfinished mark.
        (
            "pytorch.distributed",
            ["32.tmp", "step=33", "step=33-unfinished"],
            ["31", "step=x", "x.tmp", "32.orbax-checkpoint-tmp"],
        ),
    ],
)
def test_a_new_pod_finds_no_unfinished_save_of_the_previous_one_and_every_committed_step(
    tmp_path, framework, unfinished, kept
):
    for name in unfinished + kept:
        (tmp_path / name / "state").mkdir(parents=True)
        (tmp_path / name / "state" / "data").write_bytes(b"x" * 4096)
    frameworks.get(framework).clear_previous_pod(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_a_new_pod_keeps_the_restore_its_predecessor_took(tmp_path):
    (tmp_path / ".mtc-staged-30" / "0").mkdir(parents=True)
    os.symlink(".mtc-staged-30", tmp_path / "step=30")  # NeMo renamed our marker to it
    frameworks.get("pytorch.distributed").clear_previous_pod(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".mtc-staged-30", "step=30"]
