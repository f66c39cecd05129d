"""The CSI node plugin against real tmpfs mounts, over real gRPC on a unix socket."""

import concurrent.futures
import contextlib
import errno
import importlib.metadata
import os
import subprocess
import sys

import grpc
import pytest

from csi_driver import kubelet, mounts
from protos import csi_pb2, csi_pb2_grpc
from replicator.local_tier.frameworks.orbax import JAX_INIT_INFO_FILE
from tests.helpers.tools import requires_root

MiB = 1 << 20
JOB_POD = "train-slice-0-1-abcde"  # JobSet naming: job "train-slice", slice 0, worker 1


def publish(agent, target, pod=JOB_POD, **attrs):
    return kubelet.publish(agent.endpoint, str(target), pod, attributes={"size": "64Mi", **attrs})


@contextlib.contextmanager
def node_stub(agent):
    # Open channels hold the agent's graceful shutdown for its full grace period.
    with grpc.insecure_channel(agent.endpoint) as channel:
        yield csi_pb2_grpc.NodeStub(channel)


def job_mounts(agent):
    return [e for e in mounts.mount_table() if e.mount_point.startswith(os.path.realpath(agent.root))]


@requires_root
def test_data_survives_unpublish_and_new_pod_of_same_job(start_agent, tmp_path):
    agent = start_agent()
    first = tmp_path / "pods/uid-1/volumes/mount"
    volume_id = publish(agent, first)
    entry = mounts.find_mount(str(first))
    assert entry.fstype == "tmpfs" and entry.root == "/client"
    (first / "checkpoint.bin").write_bytes(b"x" * 1000)
    kubelet.unpublish(agent.endpoint, str(first), volume_id)
    assert not first.exists()

    second = tmp_path / "pods/uid-2/volumes/mount"
    second_id = publish(agent, second, pod="train-slice-0-1-fghij")
    assert second_id != volume_id
    assert (second / "checkpoint.bin").read_bytes() == b"x" * 1000


@requires_root
def test_publish_after_agent_sigkill_keeps_data_and_replaces_stale_socket(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "pods/uid-1/mount"
    publish(agent, target)
    (target / "step").write_text("42")
    agent.kill()
    assert os.path.exists(agent.endpoint[len("unix://") :]), "SIGKILL leaves the socket file behind"

    agent.start()
    assert "recovered 1 ramdisk" in agent.tail_log()
    # The old pod's mount survived the agent; the next pod of the job finds the data.
    assert (target / "step").read_text() == "42"
    kubelet.unpublish(agent.endpoint, str(target))
    second = tmp_path / "pods/uid-2/mount"
    publish(agent, second, pod="train-slice-0-1-zzzzz")
    assert (second / "step").read_text() == "42"


@requires_root
def test_kernel_enforces_size_with_enospc(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "mount"
    publish(agent, target, size="4Mi")
    with open(target / "fill", "wb") as f:
        f.write(b"\0" * (4 * MiB - 64 * 1024))
        with pytest.raises(OSError) as err:
            f.write(b"\0" * MiB)
            f.flush()
    assert err.value.errno == errno.ENOSPC


@requires_root
def test_republish_larger_grows_tmpfs_and_keeps_data(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "mount"
    publish(agent, target, size="8Mi")
    (target / "keep").write_bytes(b"k" * MiB)
    publish(agent, target, size="32Mi")
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize == 32 * MiB
    assert (target / "keep").read_bytes() == b"k" * MiB


@requires_root
def test_shrink_below_used_is_failed_precondition(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "mount"
    publish(agent, target, size="16Mi")
    (target / "big").write_bytes(b"b" * 8 * MiB)
    with pytest.raises(grpc.RpcError) as err:
        publish(agent, tmp_path / "other", size="4Mi")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot shrink" in err.value.details()
    assert (target / "big").stat().st_size == 8 * MiB


@requires_root
def test_size_beyond_the_node_memory_is_invalid_argument(start_agent, tmp_path):
    agent = start_agent()
    with pytest.raises(grpc.RpcError) as err:
        publish(agent, tmp_path / "mount", size="64Ti")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "size" in err.value.details() and "node's memory" in err.value.details()
    assert job_mounts(agent) == []


@requires_root
def test_new_publish_removes_stale_jax_init_info(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "mount"
    publish(agent, target)
    (target / JAX_INIT_INFO_FILE).write_text("3\n10.0.0.1:8476\n")
    kubelet.unpublish(agent.endpoint, str(target))
    publish(agent, target, pod="train-slice-0-1-newer")
    assert not (target / JAX_INIT_INFO_FILE).exists()


@pytest.mark.parametrize(
    "change, code, words",
    [
        ({"volume_capability": None}, grpc.StatusCode.INVALID_ARGUMENT, "volume_capability"),
        ({"volume_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "volume_id"),
        ({"target_path": ""}, grpc.StatusCode.INVALID_ARGUMENT, "target_path"),
        ({"size": "lots"}, grpc.StatusCode.INVALID_ARGUMENT, "size"),
        ({"size": "1.5"}, grpc.StatusCode.INVALID_ARGUMENT, "size"),
        ({"nodes": "four"}, grpc.StatusCode.INVALID_ARGUMENT, "nodes"),
        ({"nodes": "3", "slices": "2"}, grpc.StatusCode.INVALID_ARGUMENT, "nodes"),
        ({"job": "../../etc"}, grpc.StatusCode.INVALID_ARGUMENT, "job"),
        ({"namespace": "../x"}, grpc.StatusCode.INVALID_ARGUMENT, "namespace"),
        ({"pod": "not-a-jobset-pod"}, grpc.StatusCode.INVALID_ARGUMENT, "job"),
        ({"block": True}, grpc.StatusCode.INVALID_ARGUMENT, "block"),
    ],
)
@requires_root
def test_bad_publish_input_is_refused_and_nothing_is_mounted(start_agent, tmp_path, change, code, words):
    agent = start_agent()
    capability = csi_pb2.VolumeCapability(
        block=csi_pb2.VolumeCapability.BlockVolume() if change.get("block") else None,
        mount=None if change.get("block") else csi_pb2.VolumeCapability.MountVolume(),
        access_mode={"mode": csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER},
    )
    context = {
        "csi.storage.k8s.io/pod.name": change.get("pod", JOB_POD),
        "csi.storage.k8s.io/pod.namespace": change.get("namespace", "default"),
        "csi.storage.k8s.io/pod.uid": "uid-1",
        "csi.storage.k8s.io/ephemeral": "true",
        **{k: v for k, v in change.items() if k in ("size", "nodes", "slices", "job")},
    }
    request = csi_pb2.NodePublishVolumeRequest(
        volume_id=change.get("volume_id", "csi-1"),
        target_path=change.get("target_path", str(tmp_path / "mount")),
        volume_capability=change.get("volume_capability", capability),
        volume_context=context,
    )
    with pytest.raises(grpc.RpcError) as err, node_stub(agent) as stub:
        stub.NodePublishVolume(request, timeout=10)
    assert err.value.code() == code
    assert words in err.value.details()
    assert job_mounts(agent) == []
    assert not os.path.exists(os.path.join(agent.root, "jobs", "etc"))
    # The agent stays up and serves the next, valid request.
    publish(agent, tmp_path / "good")
    assert mounts.find_mount(str(tmp_path / "good")).fstype == "tmpfs"


def check_unpublish_arguments(stub, tmp_path):
    for request, missing in [
        (csi_pb2.NodeUnpublishVolumeRequest(target_path="/x"), "volume_id"),
        (csi_pb2.NodeUnpublishVolumeRequest(volume_id="v"), "target_path"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.NodeUnpublishVolume(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and missing in err.value.details()
    # An unknown target is already unpublished.
    stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=str(tmp_path / "nope")))


@requires_root
def test_unpublish_arguments_and_idempotency(start_agent, tmp_path):
    agent = start_agent()
    with node_stub(agent) as stub:
        check_unpublish_arguments(stub, tmp_path)
    target = tmp_path / "mount"
    publish(agent, target)
    publish(agent, target)  # idempotent: same target again is OK
    assert sum(e.mount_point == str(target) for e in mounts.mount_table()) == 1
    kubelet.unpublish(agent.endpoint, str(target))
    kubelet.unpublish(agent.endpoint, str(target))
    assert mounts.find_mount(str(target)) is None and not target.exists()


@requires_root
def test_concurrent_publishes_of_one_job_share_one_tmpfs(start_agent, tmp_path):
    agent = start_agent()
    targets = [tmp_path / f"pods/{i}/mount" for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: publish(agent, t, pod=f"train-slice-0-1-p{targets.index(t)}"), targets))
    tmpfs = [e for e in job_mounts(agent) if e.root == "/"]
    assert len(tmpfs) == 1
    (targets[0] / "shared").write_text("same")
    assert all((t / "shared").read_text() == "same" for t in targets)


@requires_root
def test_volume_stats_report_tmpfs_bytes_and_inodes(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "mount"
    volume_id = publish(agent, target, size="16Mi")
    (target / "data").write_bytes(b"d" * 3 * MiB)
    with node_stub(agent) as stub:
        stats = stub.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(target)), timeout=10
        )
    by_unit = {u.unit: u for u in stats.usage}
    data = by_unit[csi_pb2.VolumeUsage.BYTES]
    assert data.total == 16 * MiB
    assert 3 * MiB <= data.used < 3 * MiB + 64 * 1024
    assert data.available == data.total - data.used
    assert by_unit[csi_pb2.VolumeUsage.INODES].used >= 2  # the client dir and the file
    assert stats.volume_condition.abnormal is False
    with pytest.raises(grpc.RpcError) as err, node_stub(agent) as stub:
        stub.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id="other", volume_path=str(target)), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_identity_and_node_info(start_agent):
    agent = start_agent(
        "node-7",
        backend="dir",
        extra_args=["--driver-name", "ram.example.org", "--topology", "zone=a", "--topology", "block=b1"],
    )
    with grpc.insecure_channel(agent.endpoint) as channel:
        check_identity_and_node_info(channel)


def check_identity_and_node_info(channel):
    identity = csi_pb2_grpc.IdentityStub(channel)
    info = identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert (info.name, info.vendor_version) == (
        "ram.example.org",
        importlib.metadata.version("mtc-checkpointing"),
    )  # mtc --version's
    assert identity.Probe(csi_pb2.ProbeRequest()).ready.value is True
    plugin_caps = identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities
    assert all(c.service.type != csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE for c in plugin_caps)
    info = csi_pb2_grpc.NodeStub(channel).NodeGetInfo(csi_pb2.NodeGetInfoRequest())
    assert info.node_id == "node-7"
    assert dict(info.accessible_topology.segments) == {"zone": "a", "block": "b1"}
    caps = csi_pb2_grpc.NodeStub(channel).NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities
    rpc = csi_pb2.NodeServiceCapability.RPC
    assert {c.rpc.type for c in caps} == {rpc.GET_VOLUME_STATS, rpc.VOLUME_CONDITION}
    controller = csi_pb2_grpc.ControllerStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        controller.CreateVolume(csi_pb2.CreateVolumeRequest(name="v"))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_dir_backend_publishes_without_mounting_and_warns(start_agent, tmp_path):
    agent = start_agent(backend="dir")
    target = tmp_path / "mount"
    publish(agent, target)
    (target / "f").write_text("on disk")
    kubelet.unpublish(agent.endpoint, str(target))
    publish(agent, target, pod="train-slice-0-1-other")
    assert (target / "f").read_text() == "on disk"
    assert job_mounts(agent) == []
    assert "data lives on DISK" in agent.tail_log()


def test_cli_publish_failure_prints_status_code_and_exits_nonzero(start_agent, tmp_path):
    agent = start_agent(backend="dir")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "replicator.cli",
            "publish",
            "--csi-endpoint",
            agent.endpoint,
            "--target",
            str(tmp_path / "m"),
            "--pod",
            JOB_POD,
            "--attr",
            "size=huge",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.startswith("INVALID_ARGUMENT: volume attribute size")


@requires_root
def test_gc_releases_idle_ramdisk_and_refuses_busy_one(start_agent, tmp_path):
    agent = start_agent()
    target = tmp_path / "mount"
    publish(agent, target)
    gc = [sys.executable, "-m", "replicator.cli", "gc", "--root", agent.root]
    busy = subprocess.run([*gc, "--job", "default/train-slice"], capture_output=True, text=True)
    assert busy.returncode == 1 and "FAILED_PRECONDITION" in busy.stderr
    kubelet.unpublish(agent.endpoint, str(target))
    idle = subprocess.run([*gc, "--idle"], capture_output=True, text=True, check=True)
    assert "released default/train-slice" in idle.stdout
    assert job_mounts(agent) == []
