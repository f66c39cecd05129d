"""The codes' writes into caller-owned buffers (replicator/parity/codec.py ``encode_into``/``rebuild_into``) and the
decoder's reused chunk buffers (replicator/parity/buffers.py): what the encoder and the decoder reuse chunk after
chunk must give the bytes a fresh buffer gives, and a cancelled chunk's set must not reach the next chunk while
its thread still writes it."""

import asyncio
import itertools
import threading

import numpy as np
import pytest

from replicator.parity.buffers import ChunkBuffers, FreeBuffers
from replicator.parity.codec import ReedSolomon, Xor, codec

LENGTHS = [8, 24, 4104, 65544]  # multiples of 8, not of any larger power of two


def segments_of(count: int, length: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(length) for _ in range(count)]


def dirty(count: int, length: int) -> list[memoryview]:
    """Views into larger buffers full of another chunk's bytes, as a reused set hands them out."""
    return [memoryview(bytearray(b"\xa5" * (length + 64)))[:length] for _ in range(count)]


def reference_parity(code, segments: list[bytes]) -> list[bytes]:
    """The parity a code must produce, computed without the codec: the XOR of the words, or pyeclib's own."""
    if isinstance(code, Xor):
        return [np.bitwise_xor.reduce([np.frombuffer(s, dtype=np.uint64) for s in segments]).tobytes()]
    from pyeclib.ec_iface import ECDriver

    fragments = ECDriver(k=code.data, m=code.parity, ec_type="isa_l_rs_cauchy").encode(b"".join(segments))
    return [bytes(f[80:]) for f in fragments[code.data :]]


@pytest.mark.parametrize(("data", "parity"), [(1, 1), (3, 1), (7, 1), (6, 2), (5, 3)])
@pytest.mark.parametrize("length", LENGTHS)
def test_encode_into_dirty_buffers_gives_the_parity_and_the_allocating_encode_agrees(data, parity, length):
    code = codec(data, parity)
    segments = segments_of(data, length, seed=data * 10 + parity + length)
    out = dirty(parity, length)

    code.encode_into([memoryview(s) for s in segments], out)

    expected = reference_parity(code, segments)
    assert [bytes(o) for o in out] == expected
    assert code.encode(segments) == expected


@pytest.mark.parametrize(("data", "parity"), [(1, 1), (3, 1), (7, 1), (6, 2), (5, 3)])
@pytest.mark.parametrize("length", LENGTHS)
def test_rebuild_into_dirty_buffers_gives_the_lost_segments_for_every_loss(data, parity, length):
    code = codec(data, parity)
    segments = segments_of(data, length, seed=data * 7 + parity + length)
    everything = dict(enumerate(segments + reference_parity(code, segments)))
    for lost in itertools.combinations(range(data), min(parity, data)):
        survivors = {i: memoryview(s) for i, s in everything.items() if i not in lost}
        out = dict(zip(lost, dirty(len(lost), length)))

        code.rebuild_into(survivors, list(lost), out)

        assert {i: bytes(o) for i, o in out.items()} == {i: segments[i] for i in lost}, lost
        assert code.rebuild(survivors, list(lost)) == {i: segments[i] for i in lost}


def test_reed_solomon_rebuild_into_refuses_what_rebuild_refuses():
    code = ReedSolomon(4, 2)
    segments = segments_of(4, 64, 1)
    with pytest.raises(ValueError, match="cannot rebuild"):
        code.rebuild_into({0: segments[0]}, [1], {1: memoryview(bytearray(64))})
    with pytest.raises(ValueError, match="unequal"):
        code.rebuild_into({0: segments[0], 2: b"x" * 8, 3: segments[3], 4: segments[1]}, [1], {})


def test_a_sized_set_is_views_of_the_same_buffers():
    buffers = ChunkBuffers.allocate(3, 1, 64)
    sized = buffers.sized(24)
    assert [len(b) for b in sized.reads + sized.out] == [24] * 4
    sized.out[0][:] = b"z" * 24
    assert bytes(buffers.out[0][:24]) == b"z" * 24


async def test_chunks_run_one_after_the_other_reuse_one_set():
    free = FreeBuffers(2, 1, 32)
    first = await free.run(lambda b: b.out[0].obj)
    second = await free.run(lambda b: b.out[0].obj)
    assert first is second


async def test_a_cancelled_chunks_set_is_not_handed_on_while_its_thread_still_writes_it():
    free = FreeBuffers(1, 1, 16)
    started, release, written = threading.Event(), threading.Event(), threading.Event()

    def late_writer(buffers: ChunkBuffers) -> None:  # a cancelled chunk's thread: it writes after the cancel
        started.set()
        release.wait(10)
        buffers.out[0][:] = b"A" * 16
        written.set()

    def next_chunk(buffers: ChunkBuffers) -> ChunkBuffers:
        buffers.out[0][:] = b"B" * 16
        return buffers

    cancelled = asyncio.ensure_future(free.run(late_writer))
    await asyncio.to_thread(started.wait, 10)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled

    second = await free.run(next_chunk)
    release.set()
    await asyncio.to_thread(written.wait, 10)

    assert bytes(second.out[0]) == b"B" * 16  # its set was not the one still being written
    for _ in range(500):  # the late writer's set comes back once its thread is done
        if len(free._free) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(free._free) == 2
