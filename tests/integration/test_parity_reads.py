"""The parity tier's reads over real HTTP on loopback (replicator/parity/reads.py, ``RangeReads`` in
replicator/peer_tier/client.py): ranges of a member's step and of a parity shard land in the caller's reused
buffers on a worker thread, byte for byte, past the stream's end as zeros, and a missing or refused range fails
with the peer tier's errors."""

import asyncio
import os

import pytest

from replicator.parity.reads import StepReads, open_members
from replicator.peer_tier.client import PeerFetchError, RangeReads, UnusablePeerCopy, file_url
from replicator.wire.messages import MemberCopy
from tests.helpers.peer import JOB, NS, TOKEN, commit_own_step

STEP, RANK = 5, 2
FILES = {"a.bin": os.urandom(10_000), "b/c.bin": os.urandom(3_000), "empty": b"", "d.bin": os.urandom(5_000)}
STREAM = b"".join(FILES[rel] for rel in sorted(FILES))  # the member's stream: its files in sorted path order


def dirty(length: int) -> memoryview:
    return memoryview(bytearray(b"\xa5" * length))


@pytest.fixture
def ranges():
    reads = RangeReads(TOKEN, None)
    yield reads
    reads.close()


@pytest.mark.parametrize(("start", "length"), [(0, 18_000), (9_990, 20), (12_000, 6_000), (17_000, 3_000)])
async def test_a_member_stream_reads_across_files_into_a_dirty_buffer_and_pads_with_zeros(
    peer, session, ranges, start, length
):
    commit_own_step(peer.meta, STEP, RANK, FILES)
    reads = StepReads(session, TOKEN, NS, JOB, STEP)
    member = MemberCopy(rank=RANK, node="node-a", url=peer.base_url)
    streams = await open_members(reads, {0: member}, {0: len(STREAM)})
    into = dirty(length)

    await asyncio.to_thread(streams[0].read_into, ranges, start, into)

    assert bytes(into) == (STREAM + bytes(length))[start : start + length]


async def test_range_reads_one_after_another_fill_the_same_buffer(peer, ranges):
    commit_own_step(peer.meta, STEP, RANK, FILES)
    url = file_url(peer.base_url, NS, JOB, RANK, STEP, "a.bin")
    into = dirty(4_000)
    for offset in (0, 4_000, 6_000):
        await asyncio.to_thread(ranges.read_into, url, offset, into)
        assert bytes(into) == FILES["a.bin"][offset : offset + 4_000]


async def test_a_missing_step_or_a_range_past_the_file_fails_with_the_peer_tiers_errors(peer, ranges):
    commit_own_step(peer.meta, STEP, RANK, FILES)
    missing = file_url(peer.base_url, NS, JOB, RANK, STEP + 1, "a.bin")
    with pytest.raises(UnusablePeerCopy):
        await asyncio.to_thread(ranges.read_into, missing, 0, dirty(10))
    past = file_url(peer.base_url, NS, JOB, RANK, STEP, "d.bin")
    with pytest.raises(PeerFetchError, match="d.bin"):
        await asyncio.to_thread(ranges.read_into, past, 4_000, dirty(2_000))
    # the connection a failed range leaves is not reused: the next read works
    into = dirty(100)
    await asyncio.to_thread(ranges.read_into, past, 0, into)
    assert bytes(into) == FILES["d.bin"][:100]


async def test_a_wrong_token_is_refused(peer):
    commit_own_step(peer.meta, STEP, RANK, FILES)
    wrong = RangeReads("not-the-token", None)
    try:
        with pytest.raises(PeerFetchError, match="401"):
            await asyncio.to_thread(wrong.read_into, file_url(peer.base_url, NS, JOB, RANK, STEP, "a.bin"), 0, dirty(8))
    finally:
        wrong.close()
