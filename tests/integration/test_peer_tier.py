"""The peer tier on a real, small tmpfs: a push or a fetch that does not fit fails whole."""

import errno
import os

import pytest

from replicator.local_tier.step_manifest import build_manifest
from replicator.peer_tier.client import PeerFetchError, push_step
from replicator.peer_tier.protocol import UPLOAD_HEADER
from tests.helpers.peer import AUTH, JOB, NS, TOKEN, commit_own_step, fetch
from tests.helpers.ramdisks import small_tmpfs
from tests.helpers.steps import write_tree
from tests.helpers.tools import requires_root

pytestmark = requires_root


@pytest.fixture
def small_ramdisk(tmp_path):
    """A real 2 MiB tmpfs, always unmounted."""
    with small_tmpfs(str(tmp_path / "small"), "2M") as path:
        yield path


def _free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


async def test_push_larger_than_free_space_is_507_and_leaves_nothing(serve, session, small_ramdisk, tmp_path):
    peer = await serve(small_ramdisk)
    empty = _free_bytes(small_ramdisk)
    small = write_tree(str(tmp_path / "small-step"), {"a": os.urandom(512 << 10)})
    await push_step(session, peer.base_url, TOKEN, NS, JOB, small, build_manifest(small, 3, 1))
    assert set(peer.meta.replicas()) == {(1, 3)}
    free = _free_bytes(small_ramdisk)

    big = write_tree(str(tmp_path / "big-step"), {"a": os.urandom(1 << 20), "b": os.urandom(3 << 20)})
    with pytest.raises(PeerFetchError, match="HTTP 507.*does not fit"):
        await push_step(session, peer.base_url, TOKEN, NS, JOB, big, build_manifest(big, 4, 1), concurrency=1)
    assert peer.incoming() == [] and _free_bytes(small_ramdisk) == free

    async def chunks():  # no Content-Length: the limit is hit while streaming
        for _ in range(3):
            yield os.urandom(1 << 20)

    headers = {**AUTH, UPLOAD_HEADER: "ef" * 16}
    async with session.put(peer.url(f"{NS}/{JOB}/ranks/1/steps/4/files/b"), data=chunks(), headers=headers) as response:
        assert response.status == 507
        assert "does not fit" in (await response.json())["error"]
    assert peer.incoming() == [] and _free_bytes(small_ramdisk) == free
    assert set(peer.meta.replicas()) == {(1, 3)} and free < empty
    async with session.put(peer.url(f"{NS}/{JOB}/ranks/1/steps/4/files/a"), data=b"a", headers=headers) as response:
        assert response.status == 410  # the rest of a failed upload is refused, not started afresh
    assert peer.incoming() == []


async def test_fetch_into_a_ramdisk_too_small_fails_before_writing(peer, session, small_ramdisk):
    commit_own_step(peer.meta, 5, 0, {"big": os.urandom(3 << 20)})
    with pytest.raises(OSError, match="needs 3145728") as raised:
        await fetch(session, peer, 0, 5, small_ramdisk)
    assert raised.value.errno == errno.ENOSPC and os.listdir(small_ramdisk) == []
