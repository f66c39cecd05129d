"""RamdiskManager without a socket: recovery from the mount table, retention, and parsing."""

import time

import pytest

from csi_driver.quantity import parse_quantity
from csi_driver.ramdisk import DirBackend, InsufficientMemory, RamdiskManager, TmpfsBackend, make_backend
from csi_driver.volume_request import POD_UID_KEY, InvalidVolumeRequest, VolumeLimits, parse_volume_context
from tests.helpers.ramdisks import ignore_new_pod, spec


def test_publish_hook_runs_for_each_new_pod_and_not_for_a_retried_publish(tmp_path):
    seen = []
    manager = RamdiskManager(
        str(tmp_path / "root"), DirBackend(), on_new_pod=lambda disk, spec: seen.append(disk.client_dir)
    )
    target = str(tmp_path / "target")
    first = manager.publish("v1", target, spec(**{POD_UID_KEY: "uid-1"}))
    manager.publish("v1", target, spec(**{POD_UID_KEY: "uid-1"}))  # kubelet retries the same pod
    manager.publish("v2", target, spec(**{POD_UID_KEY: "uid-2"}))  # the job's next pod on this node
    other = manager.publish("v3", str(tmp_path / "other"), spec("other", **{POD_UID_KEY: "uid-3"}))
    assert seen == [first.client_dir, first.client_dir, other.client_dir]
    assert manager.find_by_target(target)[1].spec.pod_uid == "uid-2"


def test_jobset_pod_name_gives_job_slice_and_worker():
    parsed = parse_volume_context(
        {
            "csi.storage.k8s.io/pod.name": "llama-slice-1-3-x7k2p",
            "csi.storage.k8s.io/pod.namespace": "ml",
            "nodes": "8",
            "slices": "2",
        },
        default_size_bytes=1 << 30,
    )
    assert (parsed.job, parsed.slice_index, parsed.worker_index) == ("llama-slice", 1, 3)
    assert (parsed.namespace, parsed.nodes, parsed.slices, parsed.size_bytes) == ("ml", 8, 2, 1 << 30)
    assert parsed.jax_coordinator_port == 8476


@pytest.mark.parametrize(
    "extra, named",
    [({"jaxCoordinatorPort": "70000"}, "jaxCoordinatorPort"), ({"slices": "0"}, "slices"), ({"size": "0"}, "size")],
)
def test_invalid_attributes_name_the_attribute(extra, named):
    with pytest.raises(InvalidVolumeRequest, match=named):
        spec(**extra)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512Mi", 512 << 20),
        ("2Gi", 2 << 30),
        ("60000Mi", 60000 << 20),
        ("1G", 10**9),
        ("1e9", 10**9),
        ("1.5Ki", 1536),
        ("7", 7),
    ],
)
def test_parse_quantity(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["", "-1Gi", "1.5", "12XB", "Gi"])
def test_parse_quantity_rejects(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"nodes": "1000000000"}, "nodes"),  # past --max-nodes: refused before anything loops over it
        ({"nodes": "4", "slices": "8"}, "slices"),  # more slices than nodes
        ({"nodes": "\u0663"}, "nodes"),  # an Arabic-Indic 3: int() would take it
        ({"nodes": " 4"}, "nodes"),
        ({"size": "1e99999999"}, "size"),  # Decimal would overflow (or spend seconds) on it
        ({"size": "1" * 10_000}, "size"),
        ({"size": "64Ti"}, "size"),  # more than the node's memory
    ],
)
def test_unbounded_attributes_are_refused_quickly_naming_the_attribute(extra, named):
    started = time.monotonic()
    with pytest.raises(InvalidVolumeRequest, match=named):
        parse_volume_context(
            {"csi.storage.k8s.io/pod.name": "p", "job": "train", **extra}, 1 << 20, VolumeLimits(max_size_bytes=1 << 40)
        )
    assert time.monotonic() - started < 0.1


def test_jobset_names_with_non_ascii_digits_are_not_jobset_names():
    with pytest.raises(InvalidVolumeRequest, match="JobSet naming"):
        parse_volume_context({"csi.storage.k8s.io/pod.name": "llama-slice-\u0661-3-x7k2p"}, 1 << 20)


class SmallNodeBackend(TmpfsBackend):
    """Stand-in for a node with 16 MiB of memory available (the check runs before any mount)."""

    def memory_available(self) -> int:
        return 16 << 20


def test_size_the_node_cannot_back_now_is_insufficient_memory_naming_both_counts(tmp_path):
    manager = RamdiskManager(str(tmp_path / "root"), SmallNodeBackend(), on_new_pod=ignore_new_pod)
    with pytest.raises(InsufficientMemory) as err:
        manager.publish("vol-1", str(tmp_path / "target"), spec(size=64 << 20))
    assert str(64 << 20) in str(err.value) and str(16 << 20) in str(err.value) and "available" in str(err.value)
    assert manager.ramdisks() == {}


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="tmpfs or dir"):
        make_backend("zfs")
