"""The peer tier over real HTTP on loopback, in the test's event loop: push, list, fetch, Range, corruption,
auth, traversal; and on a real, small tmpfs (root): a push or a fetch that does not fit fails whole."""

import dataclasses
import errno
import os
import socket

import google_crc32c
import pytest

from prefetch import staging
from replicator.local_tier import frameworks, pod_files
from replicator.local_tier.step_manifest import StepManifest, build_manifest
from replicator.peer_tier.client import PeerFetchError, fetch_step, push_step
from replicator.peer_tier.protocol import UPLOAD_HEADER
from tests.helpers.peer import AUTH, JOB, NS, TOKEN, commit_own_step, fetch
from tests.helpers.ramdisks import small_tmpfs
from tests.helpers.steps import flip_byte, read_tree, write_tree
from tests.helpers.tools import requires_root

ORBAX = frameworks.get("orbax")
SECRET = b"TOP SECRET host data"
FILES = {
    "_CHECKPOINT_METADATA": b'{"format": "orbax"}',
    "state/manifest.ocdbt": os.urandom(300_000),
    "state/d/0a1b2c": os.urandom(70_000),
    "state/empty": b"",
}


async def test_push_list_fetch_round_trip_gives_identical_bytes(peer, session, tmp_path):
    commit_own_step(peer.meta, 5, 0, {"own.bin": b"own data"})
    source = write_tree(str(tmp_path / "source"), FILES)
    manifest = build_manifest(source, 7, 1)

    await push_step(session, peer.base_url, TOKEN, NS, JOB, source, manifest)

    async with session.get(peer.url(f"{NS}/{JOB}/steps"), headers=AUTH) as response:
        assert response.status == 200
        assert await response.json() == {
            "steps": [{"rank": 0, "step": 5, "bytes": 8}, {"rank": 1, "step": 7, "bytes": manifest.total_bytes}]
        }
    assert peer.incoming() == []
    dest = tmp_path / "fetched"
    dest.mkdir()
    fetched = await fetch(session, peer, 1, 7, str(dest), range_bytes=64 << 10, workers=3)
    assert fetched == manifest
    assert read_tree(str(dest)) == FILES
    own = tmp_path / "own"
    own.mkdir()
    await fetch(session, peer, 0, 5, str(own))
    assert read_tree(str(own)) == {"own.bin": b"own data"}


async def test_range_request_returns_the_exact_slice(peer, session):
    commit_own_step(peer.meta, 5, 0, FILES)
    headers = {**AUTH, "Range": "bytes=1000-4999"}
    async with session.get(
        peer.url(f"{NS}/{JOB}/ranks/0/steps/5/files/state/manifest.ocdbt"), headers=headers
    ) as response:
        assert response.status == 206
        assert response.headers["Content-Range"] == "bytes 1000-4999/300000"
        assert await response.read() == FILES["state/manifest.ocdbt"][1000:5000]


async def test_fetch_of_a_corrupted_replica_raises_naming_the_file(peer, session, tmp_path):
    incoming = write_tree(peer.meta.new_incoming_dir(), FILES)
    peer.meta.install_replica(incoming, build_manifest(incoming, 7, 1))
    flip_byte(os.path.join(peer.meta.replica_dir(1, 7), "state/d/0a1b2c"))
    dest = tmp_path / "fetched"
    dest.mkdir()
    with pytest.raises(PeerFetchError, match=r"state/d/0a1b2c: crc32c mismatch"):
        await fetch(session, peer, 1, 7, str(dest))


async def test_fetch_checks_the_callers_manifest_not_the_one_the_peer_serves(peer, session, tmp_path):
    owners = build_manifest(write_tree(str(tmp_path / "owner"), FILES), 7, 1)
    other = {**FILES, "state/d/0a1b2c": os.urandom(70_000)}  # same names and sizes, other bytes
    incoming = write_tree(peer.meta.new_incoming_dir(), other)
    peer.meta.install_replica(incoming, build_manifest(incoming, 7, 1))  # consistent with itself
    (tmp_path / "dest-1").mkdir()
    with pytest.raises(PeerFetchError, match=r"fails verification: state/d/0a1b2c: crc32c mismatch$"):
        await fetch_step(peer.base_url, TOKEN, NS, JOB, owners, str(tmp_path / "dest-1"))
    missing = StepManifest(7, 1, {**owners.files, "state/d/extra": (5, "00000000")})
    (tmp_path / "dest-2").mkdir()
    with pytest.raises(PeerFetchError, match=r"state/d/extra bytes 0-4: HTTP 404"):
        await fetch_step(peer.base_url, TOKEN, NS, JOB, missing, str(tmp_path / "dest-2"))


@pytest.mark.parametrize("moment", ["between its two names", "between lookup and open"])
async def test_a_step_staged_while_it_is_served_is_still_served(peer, session, tmp_path, monkeypatch, moment):
    """The holder's own restore stages the step (committed -> staged name) in a thread while a peer
    fetches it: a lookup that meets the rename must not answer 404, which would mark a good copy
    unusable for good (CI once restored step 1 instead of step 9 after this)."""
    commit_own_step(peer.meta, 9, 3, FILES)
    manifest = peer.meta.manifests()[9]
    renamed = []

    def stage_once():
        if not renamed:
            renamed.append("staging")  # stage_local looks the step up too
            renamed[0] = staging.stage_local(ORBAX, peer.meta.client_dir, 9, manifest)

    if moment == "between its two names":  # the staged name is looked for first, then the committed one
        real_is_dir = pod_files.is_dir
        monkeypatch.setattr(pod_files, "is_dir", lambda fd, name: (real_is_dir(fd, name), stage_once())[0])
    else:
        real_find = ORBAX.find_step_dir
        monkeypatch.setattr(
            ORBAX, "find_step_dir", lambda local_dir, step: (real_find(local_dir, step), stage_once())[0]
        )

    dest = tmp_path / "fetched"
    dest.mkdir()
    await fetch_step(peer.base_url, TOKEN, NS, JOB, manifest, str(dest))  # the restore plan carries the checksums
    assert renamed == [None] and os.path.isdir(os.path.join(peer.meta.client_dir, ORBAX.staged_name(9)))
    assert read_tree(str(dest)) == FILES
    async with session.get(peer.url(f"{NS}/{JOB}/ranks/3/steps/8/manifest"), headers=AUTH) as response:
        assert response.status == 404  # a step that is not held is still a 404
        assert await response.json() == {"error": "rank 3 step 8 is not held here"}


async def test_fetch_from_a_peer_that_is_gone_raises_peer_fetch_error(tmp_path):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: connections are refused
        manifest = StepManifest(7, 1, {"a": (3 << 20, "00000000"), "b": (10, "00000000")})
        with pytest.raises(PeerFetchError, match="ConnectionRefusedError"):
            await fetch_step(f"http://127.0.0.1:{port}", TOKEN, NS, JOB, manifest, str(tmp_path), range_bytes=1 << 20)


async def test_corrupt_push_is_rejected_with_422_and_nothing_is_installed(peer, session, tmp_path):
    source = write_tree(str(tmp_path / "source"), FILES)
    manifest = build_manifest(source, 7, 1)
    flip_byte(os.path.join(source, "state/d/0a1b2c"))
    headers = {**AUTH, UPLOAD_HEADER: "ab" * 16}
    for rel in FILES:
        with open(os.path.join(source, rel), "rb") as f:
            async with session.put(
                peer.url(f"{NS}/{JOB}/ranks/1/steps/7/files/{rel}"), data=f, headers=headers
            ) as response:
                assert response.status == 201
    async with session.post(
        peer.url(f"{NS}/{JOB}/ranks/1/steps/7/commit"), data=manifest.to_json(), headers=headers
    ) as response:
        assert response.status == 422
        assert (await response.json())["problems"] == ["state/d/0a1b2c: crc32c mismatch"]
    assert peer.meta.replicas() == {} and peer.incoming() == []
    assert not os.path.exists(peer.meta.replica_dir(1, 7))

    with pytest.raises(PeerFetchError, match=r"HTTP 422.*state/d/0a1b2c: crc32c mismatch"):
        await push_step(session, peer.base_url, TOKEN, NS, JOB, source, manifest)
    assert peer.meta.replicas() == {} and peer.incoming() == []


ROUTES = [
    ("GET", f"{NS}/{JOB}/steps"),
    ("GET", f"{NS}/{JOB}/ranks/0/steps/5/manifest"),
    ("GET", f"{NS}/{JOB}/ranks/0/steps/5/files/own.bin"),
    ("PUT", f"{NS}/{JOB}/ranks/1/steps/7/files/own.bin"),
    ("POST", f"{NS}/{JOB}/ranks/1/steps/7/commit"),
    ("GET", f"{NS}/%2E%2E/steps"),
    ("GET", f"{NS}/{JOB}/ranks/0/steps/5/files/..%2F..%2Fetc%2Fpasswd"),
]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", TOKEN, f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer"])
async def test_every_route_rejects_a_missing_or_wrong_token(peer, session, authorization):
    commit_own_step(peer.meta, 5, 0, {"own.bin": b"own data"})
    headers = {UPLOAD_HEADER: "cd" * 16} | ({"Authorization": authorization} if authorization else {})
    for method, path in ROUTES:
        async with session.request(method, peer.url(path), headers=headers, data=b"own data") as response:
            assert response.status == 401, (method, path)
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert await response.json() == {"error": "missing or wrong bearer token"}
    assert peer.incoming() == []


@pytest.mark.parametrize(
    ("path", "status"),
    [
        (f"{NS}/{JOB}/ranks/0/steps/5/files/..%2F..%2F..%2Fsecret.txt", 400),
        (f"{NS}/{JOB}/ranks/0/steps/5/files/state/../../../../secret.txt", 400),
        (f"{NS}/{JOB}/ranks/0/steps/5/files//etc/passwd", 400),
        (f"{NS}/{JOB}/ranks/0/steps/5/files/%2Fetc%2Fpasswd", 400),
        (f"{NS}/{JOB}/ranks/0/steps/5/files/state%5C..%5C..%5Csecret.txt", 400),
        (f"{NS}/../ranks/0/steps/5/manifest", 400),
        (f"{NS}/%2E%2E/ranks/0/steps/5/files/own.bin", 400),
        (f"{NS}/{JOB}/ranks/0/steps/5/files/state/link", 400),  # a symlink out of the step
        (f"{NS}/{JOB}/ranks/0/steps/9/files/data", 404),  # a step directory that is a symlink: not a step held here
        (f"{NS}/{JOB}/ranks/0/steps/5/files/not-in-manifest", 404),
        (f"{NS}/{JOB}/ranks/0/steps/6/manifest", 404),
        ("other/train/steps", 404),
        ("Default/train/steps", 400),
        (f"{NS}/{JOB}/ranks/x/steps/5/manifest", 400),
        (f"{NS}/{JOB}/ranks/0/steps/-5/manifest", 400),
    ],
)
async def test_get_outside_the_ramdisk_is_refused_and_leaks_nothing(peer, session, tmp_path, path, status):
    secret = write_tree(str(tmp_path / "outside"), {"secret.txt": SECRET, "data": SECRET})
    step_dir = os.path.join(peer.meta.client_dir, "5")
    write_tree(step_dir, {"own.bin": b"own data", "state/real": b"real"})
    manifest = build_manifest(step_dir, 5, 0)
    # The pod swaps a file for a symlink after the manifest was recorded.
    os.symlink(os.path.join(secret, "secret.txt"), os.path.join(step_dir, "state", "link"))
    link_entry = {"state/link": (len(SECRET), google_crc32c.value(SECRET).to_bytes(4, "big").hex())}
    peer.meta.save_manifest(dataclasses.replace(manifest, files={**manifest.files, **link_entry}))
    os.symlink(secret, os.path.join(peer.meta.client_dir, "9"))
    peer.meta.save_manifest(build_manifest(secret, 9, 0))

    async with session.get(peer.url(path), headers=AUTH) as response:
        body = await response.read()
    assert response.status == status, body
    assert SECRET not in body and b"root:" not in body
    assert "error" in (await response.json())


async def test_fetch_of_a_step_symlinked_out_of_the_ramdisk_fails(peer, session, tmp_path):
    outside = write_tree(str(tmp_path / "outside"), {"data": SECRET})
    os.makedirs(peer.meta.client_dir)
    os.symlink(outside, os.path.join(peer.meta.client_dir, "9"))
    peer.meta.save_manifest(build_manifest(outside, 9, 0))
    dest = tmp_path / "fetched"
    dest.mkdir()
    with pytest.raises(PeerFetchError, match="HTTP 404.*not held here"):
        await fetch(session, peer, 0, 9, str(dest))


@pytest.mark.parametrize(
    ("path", "upload", "status"),
    [
        (f"{NS}/{JOB}/ranks/1/steps/7/files/..%2F..%2F..%2Fescaped", "ab" * 16, 400),
        (f"{NS}/{JOB}/ranks/1/steps/7/files/%2Ftmp%2Fescaped", "ab" * 16, 400),
        (f"{NS}/..%2F..%2Fescaped/ranks/1/steps/7/files/x", "ab" * 16, 400),
        (f"{NS}/{JOB}/ranks/1/steps/7/files/x", "../../escaped", 400),
        (f"{NS}/{JOB}/ranks/1/steps/7/files/x", "", 400),
        ("other/train/ranks/1/steps/7/files/x", "ab" * 16, 404),
    ],
)
async def test_put_outside_an_upload_is_refused_and_writes_nothing(peer, session, tmp_path, path, upload, status):
    async with session.put(peer.url(path), headers={**AUTH, UPLOAD_HEADER: upload}, data=b"payload") as response:
        assert response.status == status
        assert "error" in await response.json()
    assert peer.incoming() == []
    escaped = [os.path.join(d, n) for d, _, names in os.walk(tmp_path.parent) for n in names if n == "escaped"]
    assert escaped == []


@pytest.fixture
def small_ramdisk(tmp_path):
    """A real 2 MiB tmpfs, always unmounted."""
    with small_tmpfs(str(tmp_path / "small"), "2M") as path:
        yield path


def _free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


@requires_root
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


@requires_root
async def test_fetch_into_a_ramdisk_too_small_fails_before_writing(peer, session, small_ramdisk):
    commit_own_step(peer.meta, 5, 0, {"big": os.urandom(3 << 20)})
    with pytest.raises(OSError, match="needs 3145728") as raised:
        await fetch(session, peer, 0, 5, small_ramdisk)
    assert raised.value.errno == errno.ENOSPC and os.listdir(small_ramdisk) == []
