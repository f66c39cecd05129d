"""The node agent's caches (``csi_driver.file_cache``): values are served only while what they were
read from is unchanged, and a step committed by rename is still seen at the next pass."""

import asyncio
import os
import shutil
import time

import pytest

from csi_driver import file_cache
from csi_driver.ramdisk import DirBackend, Ramdisk, RamdiskManager
from replicator.local_tier import frameworks
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.local_tier.step_manifest import StepManifest
from replicator.node.commit_detection import CommitDetector
from tests.helpers.ramdisks import ignore_new_pod, spec
from tests.helpers.steps import write_tree

ORBAX = frameworks.get("orbax")

TICK = 0.05  # longer than a file system's timestamp tick, so the next change stamps a new time


@pytest.fixture
def no_racy_window(monkeypatch):
    """Every value read is cached at once: the cache's own checks are all that stands between a
    change and a stale answer."""
    monkeypatch.setattr(file_cache, "RACY_SECONDS", 0.0)


@pytest.fixture
def manifest_parses(monkeypatch) -> list[int]:
    """The steps of every manifest file parsed from here on."""
    parsed, original = [], StepManifest.from_json

    def counting(cls, text):
        manifest = original(text)
        parsed.append(manifest.step)
        return manifest

    monkeypatch.setattr(StepManifest, "from_json", classmethod(counting))
    return parsed


def test_manifests_are_parsed_once_until_one_is_replaced(tmp_path, no_racy_window, manifest_parses):
    meta = JobMeta(str(tmp_path))
    meta.save_manifest(StepManifest(5, 0, {"a": (1, "00000001")}))
    meta.save_manifest(StepManifest(6, 0, {"a": (1, "00000001")}))
    for _ in range(3):
        assert set(meta.manifests()) == {5, 6}
    assert sorted(manifest_parses) == [5, 6]
    time.sleep(TICK)
    meta.save_manifest(StepManifest(6, 0, {"a": (1, "00000002")}))  # replaced: a new file under the name
    assert JobMeta(str(tmp_path)).manifests()[6].files == {"a": (1, "00000002")}
    assert sorted(manifest_parses) == [5, 6, 6]  # step 5 was not parsed again
    meta.drop_manifest(5)
    assert set(meta.manifests()) == {6}


def test_a_manifest_rewritten_in_place_with_its_mtime_set_back_is_read_again(tmp_path, no_racy_window):
    meta = JobMeta(str(tmp_path))
    meta.save_manifest(StepManifest(5, 0, {"a": (1, "00000001")}))
    assert meta.manifests()[5].files == {"a": (1, "00000001")}
    path = os.path.join(meta.root, "manifests", "5.json")
    before = os.stat(path)
    time.sleep(TICK)
    with open(path, "r+b") as f:  # same size, same inode, same directory
        data = f.read()
        f.seek(0)
        f.write(data.replace(b"00000001", b"00000009"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # only the ctime betrays it
    assert meta.manifests()[5].files == {"a": (1, "00000009")}


def test_a_value_read_in_the_same_second_as_its_change_is_read_again(tmp_path, manifest_parses):
    meta = JobMeta(str(tmp_path))
    meta.save_manifest(StepManifest(5, 0, {"a": (1, "00000001")}))
    meta.manifests()
    meta.manifests()
    assert manifest_parses == [5, 5]  # a second change in the same clock tick would keep the key


def test_progress_is_the_callers_own_copy_and_follows_each_save(tmp_path, no_racy_window):
    meta = JobMeta(str(tmp_path))
    assert meta.progress("uid") == PodProgress("uid")
    meta.save_progress(PodProgress("uid", "inc-1", 3, "h:1", True))
    first = meta.progress("uid")
    first.restore_done = True  # the caller's change is not the stored record
    assert meta.progress("uid") == PodProgress("uid", "inc-1", 3, "h:1", True)
    time.sleep(TICK)
    meta.save_progress(PodProgress("uid", "inc-2", 1, "h:2", True, handing_over=-1))
    assert meta.progress("uid") == PodProgress("uid", "inc-2", 1, "h:2", True, handing_over=-1)
    assert meta.progress("another pod") == PodProgress("another pod")


def test_a_step_committed_by_rename_is_seen_by_the_next_scan(tmp_path, no_racy_window):
    client = str(tmp_path)
    write_tree(os.path.join(client, "1"), {"_CHECKPOINT_METADATA": b"{}"})
    assert ORBAX.scan_steps(client).committed == [1]
    assert ORBAX.cached_scan(client).committed == [1]
    time.sleep(TICK)
    write_tree(os.path.join(client, "2.orbax-checkpoint-tmp"), {"_CHECKPOINT_METADATA": b"{}"})
    assert ORBAX.cached_scan(client) is None  # the dir changed
    assert ORBAX.scan_steps(client).committed == [1]
    time.sleep(TICK)
    write_tree(os.path.join(client, "2.orbax-checkpoint-tmp"), {"state/data": b"x"})  # inside: the dir is unchanged
    assert ORBAX.cached_scan(client).committed == [1]
    os.rename(os.path.join(client, "2.orbax-checkpoint-tmp"), os.path.join(client, "2"))
    assert ORBAX.cached_scan(client) is None
    assert ORBAX.scan_steps(client).committed == [1, 2]


def test_a_step_swapped_for_a_symlink_is_refused_though_the_dir_mtime_was_set_back(tmp_path, no_racy_window):
    client = str(tmp_path / "client")
    write_tree(os.path.join(client, "1"), {"_CHECKPOINT_METADATA": b"{}"})
    write_tree(os.path.join(client, "2"), {"_CHECKPOINT_METADATA": b"{}"})
    assert ORBAX.scan_steps(client).committed == [1, 2]
    before = os.stat(client)
    time.sleep(TICK)
    shutil.rmtree(os.path.join(client, "2"))
    os.symlink("/etc", os.path.join(client, "2"))
    os.utime(client, ns=(before.st_atime_ns, before.st_mtime_ns))  # what a pod can do; the ctime it cannot
    scan = ORBAX.scan_steps(client)
    assert (scan.committed, scan.refused) == ([1], [2])


def test_commit_detection_checksums_a_step_committed_after_the_scan_was_cached(tmp_path, no_racy_window):
    disk = Ramdisk("default", "run", 1 << 20, str(tmp_path))
    meta = JobMeta(disk.path)
    detector = CommitDetector(None, lambda: None)
    progress = PodProgress("uid", "inc", 0, "h:1", True)
    write_tree(os.path.join(disk.client_dir, "1"), {"_CHECKPOINT_METADATA": b"{}"})
    asyncio.run(detector.detect(disk, meta, progress))
    asyncio.run(detector.detect(disk, meta, progress))
    assert set(meta.manifests()) == {1} and ORBAX.cached_scan(disk.client_dir) is not None
    time.sleep(TICK)
    write_tree(
        os.path.join(disk.client_dir, "2.orbax-checkpoint-tmp"), {"_CHECKPOINT_METADATA": b"{}", "state/a": b"xy"}
    )
    os.rename(os.path.join(disk.client_dir, "2.orbax-checkpoint-tmp"), os.path.join(disk.client_dir, "2"))
    asyncio.run(detector.detect(disk, meta, progress))
    manifests = meta.manifests()
    assert set(manifests) == {1, 2}
    assert {path: size for path, (size, _) in manifests[2].files.items()} == {"_CHECKPOINT_METADATA": 2, "state/a": 2}


def test_a_ramdisk_snapshot_follows_the_state_another_process_saves(tmp_path, no_racy_window):
    root = str(tmp_path / "root")
    reader, writer = (RamdiskManager(root, DirBackend(), on_new_pod=ignore_new_pod) for _ in range(2))
    assert reader.ramdisks() == {}
    writer.publish("v1", str(tmp_path / "target"), spec("train", pod="p1"))
    assert list(reader.ramdisks()[("default", "train")].publications) == [str(tmp_path / "target")]
    assert reader.ramdisks() == writer.ramdisks()
    time.sleep(TICK)
    writer.unpublish(str(tmp_path / "target"))
    assert reader.ramdisks()[("default", "train")].publications == {}
    writer.release("default", "train")
    assert reader.ramdisks() == {}
