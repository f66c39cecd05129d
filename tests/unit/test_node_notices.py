"""The node's notices (replicator/node/notices.py) and the coordinator's intake of them
(replicator/coordinator/kube/node_notices.py): bounded, repeated at most every 5 minutes, sent until acknowledged, older
peers' reports decoding both ways, and a notice put only on a pod the API server places on the reporting node."""

import asyncio

import grpc
import msgspec
import pytest

from csi_driver import kubelet
from csi_driver.identity import IdentityServicer
from csi_driver.node import NodeServicer
from csi_driver.ramdisk import DirBackend, RamdiskManager
from csi_driver.server import start_csi_server
from csi_driver.volume_request import POD_NAME_KEY, POD_NAMESPACE_KEY, POD_UID_KEY, VolumeLimits
from replicator.backup_tier.backends import open_backup_store
from replicator.coordinator.kube.kube_events import EventType, ObjectRef
from replicator.coordinator.kube.kube_shape import FailureDomains, JobShape, PodPlace, Shapes
from replicator.coordinator.kube.node_notices import NoticeEvents, object_of
from replicator.node.notices import REPEAT_SECONDS, NodeNotices
from replicator.node.report_session import ReportSession
from replicator.node.store_check import StoreCheck
from replicator.wire.messages import MAX_NOTICE_CHARS, MAX_NOTICES, JobRef, NodeReport, Notice, ReportReply

KEY = JobRef("team", "llama")
SHAPES = Shapes(
    {
        KEY: JobShape(
            KEY,
            "llama",
            "js-uid",
            ("slice",),
            2,
            1,
            2,
            (
                PodPlace("llama-0", "uid-0", 0, 0, None, "10.0.0.1", "node-a", None),
                PodPlace("llama-1", "uid-1", 0, 1, None, "10.0.0.2", "node-b", None),
            ),
        )
    },
    (),
    {"node-a": FailureDomains(None, None, None), "node-b": FailureDomains(None, None, None)},
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_notice_pokes_a_report_and_goes_with_each_until_acknowledged():
    session = ReportSession("node-a", "https://node-a", None, {}, 1, True)
    pokes = []
    session.poke = lambda: pokes.append(1)  # type: ignore[method-assign]
    session.notices.poke = session.poke
    session.notices.refused(
        {POD_NAMESPACE_KEY: "team", POD_NAME_KEY: "llama-0", POD_UID_KEY: "uid-0"}, "ramdisk too large for the node"
    )
    assert pokes == [1]
    first = session.build((), (), (), (), waiting=False)
    assert first.notices == (
        Notice("VolumeRefused", "volume refused: ramdisk too large for the node", "team", "uid-0"),
    )
    assert session.build((), (), (), (), waiting=False).notices == first.notices  # a failed report: again
    session.notices.add("RamdiskNearlyFull", "ramdisk too small", "team", "uid-0")  # while the report flies
    session.acknowledge(first, ReportReply((), heartbeat_seconds=10.0), 0.0)
    assert session.poked  # the newer notice goes at once
    second = session.build((), (), (), (), waiting=False)
    assert [n.reason for n in second.notices] == ["RamdiskNearlyFull"]
    session.acknowledge(second, ReportReply((), heartbeat_seconds=10.0), 0.1)
    assert not session.poked and session.build((), (), (), (), waiting=False).notices == ()


def test_a_repeat_waits_five_minutes_the_pending_are_bounded_and_a_message_is_cut():
    clock = Clock()
    notices = NodeNotices(clock)
    notices.add("BackupStoreUnusable", "backup store gs://b unusable: 403")
    notices.sent(notices.pending())
    notices.add("BackupStoreUnusable", "backup store gs://b unusable: 403")
    assert notices.pending() == ()
    clock.now = REPEAT_SECONDS + 1
    notices.add("BackupStoreUnusable", "backup store gs://b unusable: 403")
    assert len(notices.pending()) == 1
    for i in range(2 * MAX_NOTICES):
        notices.add("VolumeRefused", "x" * (2 * MAX_NOTICE_CHARS) + str(i), "team", f"uid-{i}")
    pending = notices.pending()
    assert len(pending) == MAX_NOTICES
    assert {len(n.message) for n in pending[1:]} == {MAX_NOTICE_CHARS}
    assert pending[1].message.endswith("...")


def test_reports_with_notices_and_without_decode_on_either_side():
    notice = Notice("RamdiskNearlyFull", "ramdisk too small", "team", "uid-0")
    report = NodeReport("node-a", "https://node-a", None, {}, (), (), notices=(notice,))

    class OldReport(msgspec.Struct):  # a 0.2.0 coordinator's NodeReport: no notices field
        node_id: str
        url: str
        pod_address: str | None
        topology: dict[str, str]
        pods: tuple
        held: tuple

    old = msgspec.json.decode(msgspec.json.encode(report), type=OldReport)
    assert old.node_id == "node-a"
    from_old_agent = msgspec.json.encode(old)
    assert msgspec.json.decode(from_old_agent, type=NodeReport).notices == ()
    assert msgspec.json.decode(msgspec.json.encode(report), type=NodeReport).notices == (notice,)
    too_many = msgspec.json.encode(msgspec.structs.replace(report, notices=(notice,) * (MAX_NOTICES + 1)))
    with pytest.raises(msgspec.ValidationError, match="notices"):
        msgspec.json.decode(too_many, type=NodeReport)


def test_a_notice_names_only_a_pod_the_api_server_places_on_the_reporting_node():
    on_a = Notice("VolumeRefused", "refused", "team", "uid-0")
    assert object_of("node-a", on_a, SHAPES) == ObjectRef("Pod", "v1", "team", "llama-0", "uid-0")
    assert object_of("node-b", on_a, SHAPES) is None  # another node's pod
    assert object_of("node-a", Notice("VolumeRefused", "refused", "other", "uid-0"), SHAPES) is None
    assert object_of("node-a", Notice("VolumeRefused", "refused", "team", "uid-9"), SHAPES) is None
    node = Notice("BackupStoreUnusable", "unusable")
    assert object_of("node-a", node, SHAPES) == ObjectRef("Node", "v1", "", "node-a", "node-a")
    assert object_of("node-z", node, SHAPES) is None  # a Node the API server does not know


def test_the_coordinator_records_known_reasons_as_warnings_prefixed_with_the_node():
    recorded = []

    class Recorder:
        def record(self, ref, type_, reason, message):
            recorded.append((ref.name, type_, reason, message))

    notices = (
        Notice("RamdiskNearlyFull", "ramdisk too small", "team", "uid-0"),
        Notice("Created", "a reason no node may ask for", "team", "uid-0"),
        Notice("VolumeRefused", "refused", "team", "uid-1"),  # node-b's pod
    )
    report = NodeReport("node-a", "https://node-a", None, {}, (), (), notices=notices)
    NoticeEvents(Recorder()).take(report, SHAPES)  # type: ignore[arg-type]
    assert recorded == [("llama-0", EventType.WARNING, "RamdiskNearlyFull", "node node-a: ramdisk too small")]


def test_a_refused_publish_over_grpc_is_a_volume_refused_notice_on_the_pod(tmp_path):
    notices = NodeNotices()
    manager = RamdiskManager(str(tmp_path / "root"), DirBackend(), on_new_pod=lambda disk, spec: None)
    node = NodeServicer(
        manager, "node-a", {}, 64 << 20, VolumeLimits(max_size_bytes=1 << 30), on_refused=notices.refused
    )
    endpoint = f"unix://{tmp_path}/csi.sock"
    server = start_csi_server(endpoint, IdentityServicer("mtc.dev", lambda: True), node)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.publish(
                endpoint, str(tmp_path / "target"), "llama-slice-0-0-abcde", "team", "uid-0", attributes={"size": "2Gi"}
            )
        kubelet.publish(
            endpoint, str(tmp_path / "ok"), "llama-slice-0-1-abcde", "team", "uid-1", attributes={"size": "8Mi"}
        )
    finally:
        server.stop(None)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (notice,) = notices.pending()  # the publish that passed is no notice
    assert (notice.reason, notice.namespace, notice.pod_uid) == ("VolumeRefused", "team", "uid-0")
    assert notice.message == f"volume refused: {refused.value.details()}"


async def test_a_store_unusable_at_the_start_is_one_backup_store_unusable_notice_on_the_node(tmp_path):
    (tmp_path / "store").write_text("not a directory")
    store = open_backup_store(f"file://{tmp_path}/store")
    check, stop = StoreCheck(store.url), asyncio.Event()
    running = asyncio.create_task(check.run(store.objects, "node-a", stop))
    while check.result is None:
        await asyncio.sleep(0.01)
    stop.set()
    await running
    (notice,) = check.notices.pending()
    assert (notice.reason, notice.namespace, notice.pod_uid) == ("BackupStoreUnusable", None, None)
    assert notice.message.startswith(f"backup store file://{tmp_path}/store unusable: upload failed: ")
