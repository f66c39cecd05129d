"""NeMo's saves through the Resiliency library: ``step=<G>/`` is the job's save in progress, committed by its
rename to ``<G-1>``; a ``step=<n>`` restore the job took is always our symlink. Told apart by what the entry
is, never by its name (real files on a real directory, the real agent code and the client's file order; no
processes)."""

import os
import shutil
import threading

import pytest

from csi_driver.ramdisk import Ramdisk
from prefetch import staging
from replicator.local_tier import frameworks, steps
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import build_manifest
from tests.helpers import nemo_client
from tests.helpers.steps import write_tree

TORCH = frameworks.get("pytorch.distributed")
RANK = 1


def scan(local) -> tuple[list[int], list[int], list[int]]:
    found = TORCH.scan_steps(str(local))
    return found.committed, found.refused, found.uncommitted


def test_every_moment_of_a_save_is_neither_an_error_nor_a_restore_until_the_rename_commits_g_minus_1(tmp_path):
    mark, save = tmp_path / "step=12-unfinished", tmp_path / "step=12"
    mark.touch()
    save.mkdir()
    assert scan(tmp_path) == ([], [], [])  # marked unfinished: the job's own, not a step
    nemo_client.save_files(save, 12, {2: b"a" * 64, 3: b"b" * 64})
    assert scan(tmp_path) == ([], [], [])
    mark.unlink()
    assert scan(tmp_path) == ([], [], [12])  # finished, reports read, not yet renamed
    os.rename(save, tmp_path / "11")
    assert scan(tmp_path) == ([11], [], [])
    manifest = build_manifest(str(tmp_path / "11"), 11, RANK)
    assert TORCH.missing_commit_evidence(manifest.files) is None
    assert sorted(manifest.files) == [
        "2/.metadata",
        "2/__2_0.distcp",
        "3/.metadata",
        "3/__3_0.distcp",
        "common.pt",
        "metadata.json",
    ]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("our marker, taken", ([7], [], [])),
        ("a directory", ([], [], [7])),
        ("a directory marked unfinished", ([], [], [])),
        ("a symlink elsewhere", ([], [7], [])),
        ("a symlink to a staged name holding no directory", ([], [7], [])),
        ("a file", ([], [7], [])),
    ],
)
def test_what_is_under_step_n_decides_never_its_name(tmp_path, entry, expected):
    (tmp_path / ".mtc-staged-7").mkdir()
    (tmp_path / "elsewhere").mkdir()
    name = tmp_path / "step=7"
    if entry == "our marker, taken":
        TORCH.write_restore_marker(str(tmp_path), "llama", 7, RANK)
        assert nemo_client.take_restore(tmp_path, timeout=1) == 7
    elif entry.startswith("a directory"):
        name.mkdir()
        if entry.endswith("unfinished"):
            (tmp_path / "step=7-unfinished").touch()
    elif entry == "a symlink elsewhere":
        os.symlink("elsewhere", name)
    elif entry.startswith("a symlink to a staged name"):
        os.rmdir(tmp_path / ".mtc-staged-7")
        (tmp_path / ".mtc-staged-7").write_text("not a directory")
        os.symlink(".mtc-staged-7", name)
    else:
        name.write_text("a file")
    assert scan(tmp_path) == expected


def test_a_restore_removes_the_saves_nemo_would_load_instead_and_leaves_it_those_it_removes_itself(tmp_path):
    disk = Ramdisk("default", "llama", 1 << 20, str(tmp_path))
    meta, local = JobMeta(disk.path), tmp_path / "client"
    write_tree(local / "5", {"1/.metadata": b"m", "1/__1_0.distcp": b"d"})
    meta.save_manifest(build_manifest(str(local / "5"), 5, RANK))
    for save in ("step=3", "step=9", "step=12"):  # a killed pod's: older, finished but not renamed, unfinished
        (local / save).mkdir()
        nemo_client.save_files(local / save, int(save[5:]), {RANK: b"x" * 64})
    (local / "step=12-unfinished").touch()
    staging.stage_local(TORCH, str(local), 5, meta.manifests()[5], meta, RANK)
    assert staging.clear_for_restore(TORCH, str(local), 5, meta, RANK) == [9]
    assert sorted(os.listdir(local)) == [".mtc-staged-5", "step=12", "step=12-unfinished", "step=3"]
    TORCH.write_restore_marker(str(local), "llama", 5, RANK)
    # NeMo's start-up: its unfinished save goes, then it loads the newest step=<n> it finds: ours.
    nemo_client.remove_unfinished(local)
    assert nemo_client.take_restore(local, timeout=1) == 5
    assert nemo_client.newest_save(local) == local / "step=5"


def test_a_save_the_job_deletes_at_the_same_time_is_deleted_without_an_error(tmp_path):
    for attempt in range(10):
        write_tree(tmp_path / "step=9", {f"{rank}/__{rank}_{i}.distcp": b"x" for rank in range(4) for i in range(200)})
        job = threading.Thread(target=shutil.rmtree, args=(tmp_path / "step=9",), kwargs={"ignore_errors": True})
        job.start()
        steps.delete_step(TORCH, str(tmp_path), 9)  # renames it away, then removes what the job has not
        job.join()
        assert os.listdir(tmp_path) == [], f"attempt {attempt}"
