"""Adjacent protocol versions interoperate, both ways; two apart and version 1 are refused with both
versions named (``replicator.wire.messages.check_version``)."""

import msgspec
import pytest

from replicator.wire.messages import (
    OLDEST_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    NodeReport,
    ProtocolMismatch,
    ReportReply,
    check_version,
    compatible_versions,
    decode_json,
)
from tests.helpers.reports import node_report


@pytest.mark.parametrize("ours, oldest, works_with", [(5, 2, [4, 5, 6]), (3, 2, [2, 3, 4]), (2, 2, [2, 3])])
def test_a_version_works_with_its_neighbours_and_nothing_further(ours, oldest, works_with):
    assert [v for v in range(0, 10) if v in compatible_versions(ours, oldest)] == works_with


def test_this_release_accepts_the_adjacent_versions():
    adjacent = [
        v for v in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION, PROTOCOL_VERSION + 1) if v >= OLDEST_PROTOCOL_VERSION
    ]
    assert list(compatible_versions()) == adjacent
    for theirs in adjacent:
        check_version(theirs, "the node agent")


@pytest.mark.parametrize("theirs", [1, PROTOCOL_VERSION - 2, PROTOCOL_VERSION + 2])
def test_further_apart_is_refused_with_both_versions_and_the_way_out_named(theirs):
    with pytest.raises(ProtocolMismatch) as err:
        check_version(theirs, "node agent node-7")
    assert str(err.value) == (
        f"node agent node-7 speaks mtc protocol version {theirs}; this side speaks version {PROTOCOL_VERSION} and works "
        f"with versions {compatible_versions().start}-{compatible_versions().stop - 1} (adjacent releases): upgrade one "
        f"release at a time, the coordinator first (docs/upgrading.md)"
    )


def test_messages_of_a_newer_version_decode_with_their_new_fields_left_out():
    report = msgspec.to_builtins(node_report("n", protocol=PROTOCOL_VERSION + 1))
    report["a_field_of_the_next_version"] = {"any": [1, 2]}
    decoded = decode_json(msgspec.json.encode(report), NodeReport)
    assert decoded.protocol == PROTOCOL_VERSION + 1 and decoded.node_id == "n"
    reply = decode_json(b'{"assignments": [], "protocol": %d, "new_orders": [1]}' % (PROTOCOL_VERSION + 1), ReportReply)
    assert reply.protocol == PROTOCOL_VERSION + 1 and reply.assignments == ()
