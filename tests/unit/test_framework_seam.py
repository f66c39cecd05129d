"""The node code reaches the training framework only through ``frameworks.Framework``: a job whose
volume asks for another framework gets that framework's layout, hand-shake and markers (a tiny fake
framework here; real files on a real directory, the real node agent code; no processes)."""

import asyncio
import os

import pytest

from csi_driver.ramdisk import DirBackend, Ramdisk, RamdiskManager
from csi_driver.volume_request import InvalidVolumeRequest, VolumeLimits, parse_volume_context
from prefetch.restore import hand_over
from replicator.local_tier import frameworks, pod_files
from replicator.local_tier.frameworks import Framework, StepScan
from replicator.local_tier.frameworks.base import ConfigFile
from replicator.local_tier.frameworks.orbax import JAX_INIT_INFO_FILE, restore_marker_name
from replicator.local_tier.job_meta import JobMeta, PodProgress
from replicator.node.agent import on_new_pod
from replicator.node.commit_detection import CommitDetector
from replicator.node.handshake import apply_assignment
from replicator.wire.messages import Assignment, JobSettings
from tests.helpers.steps import write_tree


class Fake:
    """A framework unlike Orbax in every name: steps ``step=<n>/``, staged ``.fake-<n>``, commit
    evidence ``.metadata``, rank file ``rank``, marker ``<job>.go`` holding the step."""

    name = "fake"

    def __init__(self):
        self.cleared: list[str] = []

    def scan_steps(self, local_dir: str) -> StepScan:
        committed, staged = [], []
        for name in os.listdir(local_dir):
            if name.startswith("step=") and os.path.isdir(os.path.join(local_dir, name)):
                committed.append(int(name[5:]))
            elif name.startswith(".fake-"):
                staged.append(int(name[6:]))
        return StepScan(sorted(committed), sorted(staged), [])

    def cached_scan(self, local_dir: str) -> StepScan | None:
        return None

    def find_step_dir(self, local_dir: str, step: int) -> str | None:
        found = [os.path.join(local_dir, n) for n in self.step_names(step) if os.path.isdir(os.path.join(local_dir, n))]
        return found[0] if found else None

    def staged_name(self, step: int) -> str:
        return f".fake-{step}"

    def resharded_name(self, step: int) -> str:
        return f".fake-resharded-{step}"

    def step_names(self, step: int) -> tuple[str, ...]:
        return self.staged_name(step), f"step={step}"

    def steps_restored_instead(self, scan: StepScan, step: int | None) -> list[int]:
        return [s for s in scan.committed if step is None or s > step]

    def missing_commit_evidence(self, files) -> str | None:
        return None if ".metadata" in files else "the fake's .metadata"

    def logical_signature(self, files) -> str | None:
        return None

    def write_init_info(self, local_dir: str, rank: int, coordinator_address: str) -> None:
        with open(os.path.join(local_dir, "rank"), "w") as f:
            f.write(str(rank))

    def read_config(self, local_dir: str) -> ConfigFile | None:
        return None

    def parse_config(self, text: str, expected_rank: int, expected_nodes: int) -> JobSettings:
        return JobSettings((), 1, 30.0, None)

    def consume_config(self, local_dir: str) -> None:
        pass

    def clear_previous_pod(self, local_dir: str) -> None:
        self.cleared.append(local_dir)

    def write_restore_marker(self, local_dir: str, job: str, step: int, rank: int, resharded: bool = False) -> str:
        with open(os.path.join(local_dir, f"{job}.go"), "w") as f:
            f.write(str(step))
        return os.path.join(local_dir, f"{job}.go")

    def write_fresh_start_marker(self, local_dir: str, job: str, rank: int) -> str:
        return self.write_restore_marker(local_dir, job, 0, rank)

    def remove_markers(self, local_dir: str) -> None:
        pass

    def report_error(self, local_dir: str, log_dir: str, message: str) -> None:
        with open(os.path.join(local_dir, "fake.errors"), "a") as f:
            f.write(message + "\n")

    def report_failure(self, local_dir: str, log_dir: str, message: str) -> None:
        raise AssertionError(message)


@pytest.fixture
def fake(monkeypatch):
    framework = Fake()
    monkeypatch.setitem(frameworks.REGISTRY, framework.name, framework)
    return framework


def fake_job(tmp_path, fake) -> tuple[Ramdisk, JobMeta]:
    """A published job whose volume asks for the fake framework."""
    manager = RamdiskManager(str(tmp_path / "root"), DirBackend(), on_new_pod=on_new_pod)
    context = {
        "csi.storage.k8s.io/pod.name": "run-0-0-x",
        "csi.storage.k8s.io/pod.uid": "uid",
        "job": "run",
        "framework": "fake",
    }
    spec = parse_volume_context(context, 1 << 20, VolumeLimits(frameworks=frozenset(frameworks.REGISTRY)))
    disk = manager.publish("v", str(tmp_path / "target"), spec)
    return disk, JobMeta(disk.path)


def test_every_registered_framework_satisfies_the_protocol_under_its_own_name():
    assert frameworks.REGISTRY and all(
        isinstance(f, Framework) and f.name == name for name, f in frameworks.REGISTRY.items()
    )
    assert frameworks.get(frameworks.DEFAULT).name == "orbax"
    assert sorted(frameworks.REGISTRY) == ["orbax", "pytorch.distributed"]
    # Plain ``pytorch`` (one torch.save file per worker) is not served: docs/frameworks.md says why.
    with pytest.raises(frameworks.UnknownFramework, match="'pytorch': this node serves orbax, pytorch.distributed"):
        frameworks.get("pytorch")


def test_a_volume_asking_for_a_framework_the_node_does_not_serve_is_refused_before_anything_is_made(tmp_path):
    context = {"csi.storage.k8s.io/pod.name": "run-0-0-x", "job": "run", "framework": "pytorch"}
    with pytest.raises(
        InvalidVolumeRequest, match="framework='pytorch' is not served here: use one of orbax, pytorch.distributed"
    ):
        parse_volume_context(context, 1 << 20, VolumeLimits(frameworks=frozenset(frameworks.REGISTRY)))
    assert parse_volume_context({**context, "framework": "orbax"}, 1 << 20).framework == "orbax"
    del context["framework"]
    assert parse_volume_context(context, 1 << 20).framework == "orbax"


def test_the_publish_hook_clears_with_the_pods_framework_and_records_it_on_the_ramdisk(tmp_path, fake):
    disk, meta = fake_job(tmp_path, fake)
    assert fake.cleared == [disk.client_dir]
    assert meta.framework is fake and JobMeta(disk.path).framework is fake  # read back from the ramdisk
    assert JobMeta(str(tmp_path / "never-published")).framework is frameworks.get("orbax")


def test_hand_shake_commit_detection_and_markers_go_through_the_jobs_framework(tmp_path, fake):
    disk, meta = fake_job(tmp_path, fake)
    progress = apply_assignment(disk, meta, PodProgress("uid"), Assignment("uid", "inc", 2, "h:1"))
    assert open(os.path.join(disk.client_dir, "rank")).read() == "2"
    assert not os.path.exists(os.path.join(disk.client_dir, JAX_INIT_INFO_FILE))

    write_tree(os.path.join(disk.client_dir, "step=7"), {".metadata": b"m", "__0_0.distcp": b"x" * 32})
    write_tree(os.path.join(disk.client_dir, "step=8"), {"__0_0.distcp": b"y" * 32})  # no commit evidence
    write_tree(os.path.join(disk.client_dir, "9"), {"_CHECKPOINT_METADATA": b"{}"})  # an Orbax step: not the fake's
    asyncio.run(CommitDetector(None, lambda: None).detect(disk, meta, progress))
    assert sorted(meta.manifests()) == [7] and set(meta.manifests()[7].files) == {".metadata", "__0_0.distcp"}
    assert "step 8 lacks the fake's .metadata" in open(os.path.join(disk.client_dir, "fake.errors")).read()

    os.rename(os.path.join(disk.client_dir, "step=7"), os.path.join(disk.client_dir, fake.staged_name(7)))
    hand_over(disk, meta, progress, 7, "local")
    assert open(os.path.join(disk.client_dir, "run.go")).read() == "7"
    assert not os.path.lexists(os.path.join(disk.client_dir, restore_marker_name("run", 7, 2)))
    assert not os.path.exists(os.path.join(disk.client_dir, "step=8"))  # newer than the restored step: taken out
    with pod_files.open_dir(disk.client_dir) as fd:
        assert pod_files.is_dir(fd, fake.staged_name(7))
