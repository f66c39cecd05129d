"""The backup store, parametrised over backends: file://, a real fake-gcs-server through
google-cloud-storage, and a real MinIO through boto3 (as probed, and pinned to the fallback modes of a
store without CRC32C checksums or conditional writes)."""

import base64
import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Callable

import blake3
import google_crc32c
import pytest

from replicator.backup_tier import shared_upload
from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.layout import RankManifest
from replicator.backup_tier.object_store import BackupError
from replicator.backup_tier.s3 import PART_BYTES, S3Features, S3Objects
from replicator.backup_tier.store import BackupStore
from replicator.backup_tier.transfers import RankUpload
from replicator.local_tier.step_manifest import StepManifest, build_manifest
from replicator.wire.messages import JobRef
from tests.helpers.servers import FakeGcsServer, MinioServer
from tests.helpers.steps import read_tree, write_step
from tests.helpers.tools import require_tool

JOB = JobRef("team-a", "llama")
MiB = 1 << 20


@pytest.fixture(scope="module")
def fake_gcs_module():
    server = FakeGcsServer(require_tool("fake-gcs-server")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def minio_module(tmp_path_factory):
    server = MinioServer(require_tool("minio"), str(tmp_path_factory.mktemp("minio"))).start()
    try:
        yield server
    finally:
        server.stop()


@dataclasses.dataclass
class Backend:
    """A store under test, and its objects reached directly (not through ``BackupStore``).

    Attributes:
      store: the store.
      names: every object name, relative to the store's prefix, sorted.
      overwrite: replaces an object's bytes.
      interrupt: leaves what an agent killed while uploading an object leaves, or None where that
        is invisible (a GCS resumable session, which expires by itself).
      partial: names of what ``interrupt`` left that is still there.
    """

    store: BackupStore
    names: Callable[[], list[str]]
    overwrite: Callable[[str, bytes], None]
    interrupt: Callable[[str], None] | None = None
    partial: Callable[[], list[str]] = list


PREFIX = "checkpoints/"


def gs_backend(request, tmp_path_factory) -> Backend:
    server: FakeGcsServer = request.getfixturevalue("fake_gcs_module")
    bucket = server.client().create_bucket(f"backup-{uuid.uuid4().hex[:12]}")
    return Backend(
        open_backup_store(f"gs://{bucket.name}/{PREFIX}", emulator_host=server.url),
        lambda: sorted(b.name.removeprefix(PREFIX) for b in bucket.list_blobs(prefix=PREFIX)),
        lambda name, data: bucket.blob(PREFIX + name).upload_from_string(data),
    )


def s3_backend(request, tmp_path_factory, features: S3Features | None = None) -> Backend:
    server: MinioServer = request.getfixturevalue("minio_module")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for key, value in server.client_env().items():  # boto3's standard configuration
        monkeypatch.setenv(key, value)
    client, bucket = server.client(), f"backup-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)

    def names() -> list[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX)
        return sorted(o["Key"].removeprefix(PREFIX) for page in pages for o in page.get("Contents", []))

    def interrupt(name: str) -> None:
        upload = client.create_multipart_upload(Bucket=bucket, Key=PREFIX + name)
        client.upload_part(
            Bucket=bucket, Key=PREFIX + name, UploadId=upload["UploadId"], PartNumber=1, Body=os.urandom(PART_BYTES)
        )

    def partial() -> list[str]:
        return sorted(
            u["Key"].removeprefix(PREFIX) for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        )

    return Backend(
        BackupStore(S3Objects(bucket, PREFIX, features=features)),
        names,
        lambda name, data: client.put_object(Bucket=bucket, Key=PREFIX + name, Body=data),
        interrupt,
        partial,
    )


def file_backend(request, tmp_path_factory) -> Backend:
    root = tmp_path_factory.mktemp("store")

    def overwrite(name: str, data: bytes) -> None:
        (root / name).write_bytes(data)

    def interrupt(name: str) -> None:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / f"{name}.tmp-{uuid.uuid4().hex}").write_bytes(b"partial")

    return Backend(
        open_backup_store(f"file://{root}"),
        lambda: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()),
        overwrite,
        interrupt,
        lambda: sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-*")),
    )


BACKENDS = {
    "file": file_backend,
    "gs": gs_backend,
    "s3": s3_backend,
    # What a store without CRC32C checksums or conditional writes gets: Content-MD5, checked ETags,
    # check-then-write. MinIO supports both, so the fallbacks are pinned to be tested on it.
    "s3-legacy": lambda request, factory: s3_backend(
        request, factory, S3Features(crc32c=False, conditional_writes=False)
    ),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request, tmp_path_factory) -> Backend:
    return BACKENDS[request.param](request, tmp_path_factory)


def with_crc32c_footer(data: bytes) -> bytes:
    """``data`` plus its CRC32C, little-endian, as OCDBT writes it: the whole has CRC32C 48674bc7."""
    return data + google_crc32c.value(data).to_bytes(4, "little")


def rank_files(rank: int) -> dict[str, bytes]:
    """A rank's step: a file over 8 MiB (a resumable upload), nested small files, an empty file."""
    return {
        "state/d/big": os.urandom(9 * MiB + 3),
        "state/manifest.ocdbt": f"rank {rank} ".encode() * 100,
        "_CHECKPOINT_METADATA": b'{"step": 5}',
        "commit_success.txt": b"",
    }


def upload_step(
    store: BackupStore, tmp_path, step: int, ranks: int, files=None, timeline: int = 0
) -> dict[int, dict[str, bytes]]:
    """Uploads ``ranks`` ranks of ``step`` of ``timeline`` (``files(rank)`` each, default ``rank_files``) and commits."""
    sources = {}
    for rank in range(ranks):
        sources[rank] = (files or rank_files)(rank)
        step_dir, manifest = write_step(tmp_path / f"src-{step}-{timeline}-{rank}", step, rank, sources[rank])
        store.upload_rank(RankUpload(JOB, step, rank, step_dir, manifest, timeline=timeline))
    assert store.commit_if_complete(JOB, step, ranks, timeline=timeline)
    return sources


def incomplete_steps(store: BackupStore) -> list[tuple[int, int]]:
    """(step, timeline) of JOB's steps with objects or partial uploads but no ``COMMIT``, ascending: uploads in
    progress or interrupted."""
    return sorted(step for step, committed in store.steps(JOB, partial=True).items() if not committed)


def test_step_is_restorable_only_after_every_rank_uploaded(backend, tmp_path):
    store = backend.store
    sources = {rank: rank_files(rank) for rank in range(2)}
    dirs = {rank: write_step(tmp_path / f"src-{rank}", 5, rank, sources[rank]) for rank in range(2)}

    store.upload_rank(RankUpload(JOB, 5, 0, *dirs[0]))
    assert not store.commit_if_complete(JOB, 5, nodes=2)
    assert store.complete_steps(JOB) == []
    assert incomplete_steps(store) == [(5, 0)]
    with pytest.raises(BackupError, match="no COMMIT"):
        store.download_rank(JOB, 5, 0, str(tmp_path / "early"))
    assert not (tmp_path / "early").exists()
    with pytest.raises(BackupError, match="COMMIT is missing: step 5 is not restorable"):
        store.committed_nodes(JOB, 5)

    store.upload_rank(RankUpload(JOB, 5, 1, *dirs[1]))
    assert store.commit_if_complete(JOB, 5, nodes=2)
    assert store.commit_if_complete(JOB, 5, nodes=2)  # idempotent
    assert store.complete_steps(JOB) == [(5, 0)]
    assert store.committed_nodes(JOB, 5) == 2
    assert incomplete_steps(store) == []
    assert json.loads(store.objects.read_text(f"{JOB}/steps/5/COMMIT")) == {"step": 5, "nodes": 2, "ranks": [0, 1]}

    for rank in range(2):
        dest = tmp_path / f"restored-{rank}"
        manifest = store.download_rank(JOB, 5, rank, str(dest), workers=4)
        assert manifest == dirs[rank][1]
        assert read_tree(dest) == sources[rank]
    assert sorted(os.listdir(tmp_path)) == ["restored-0", "restored-1", "src-0", "src-1"]  # no temporaries left


def test_corrupted_object_fails_restore_and_leaves_nothing(backend, tmp_path):
    sources = upload_step(backend.store, tmp_path, 5, ranks=1)
    name = f"{JOB}/steps/5/rank-0/state/d/big"
    damaged = bytearray(sources[0]["state/d/big"])
    damaged[4 * MiB] ^= 0xFF
    backend.overwrite(name, bytes(damaged))

    with pytest.raises(BackupError, match="state/d/big: crc32c mismatch"):
        backend.store.download_rank(JOB, 5, 0, str(tmp_path / "restored"))
    assert not [n for n in os.listdir(tmp_path) if "restored" in n]


def test_truncated_or_missing_object_fails_restore(backend, tmp_path):
    sources = upload_step(backend.store, tmp_path, 5, ranks=1)
    backend.overwrite(f"{JOB}/steps/5/rank-0/state/d/big", sources[0]["state/d/big"][:MiB])
    with pytest.raises(BackupError, match="state/d/big: object ends at byte 1048576"):
        backend.store.download_rank(JOB, 5, 0, str(tmp_path / "a"))
    backend.overwrite(f"{JOB}/steps/5/rank-0/state/d/big", sources[0]["state/d/big"])

    backend.store.objects.delete(f"{JOB}/steps/5/rank-0/state/manifest.ocdbt")
    with pytest.raises(BackupError, match="state/manifest.ocdbt"):
        backend.store.download_rank(JOB, 5, 0, str(tmp_path / "b"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".a", "a", ".b", "b"))]


def test_upload_not_matching_manifest_stays_incomplete_and_retain_cleans_it(backend, tmp_path):
    store = backend.store
    files = rank_files(0)
    step_dir, manifest = write_step(tmp_path / "src", 3, 0, files)
    wrong = {
        **manifest.files,
        "state/d/big": (manifest.files["state/d/big"][0], "00000000"),
        "_CHECKPOINT_METADATA": (manifest.files["_CHECKPOINT_METADATA"][0], "00000000"),
    }
    with pytest.raises(BackupError, match="2 of 4 uploads"):
        store.upload_rank(RankUpload(JOB, 3, 0, step_dir, StepManifest(3, 0, wrong)))

    # The matching files were stored, the mismatching ones were not, and no rank manifest exists.
    assert backend.names() == [f"{JOB}/steps/3/rank-0/commit_success.txt", f"{JOB}/steps/3/rank-0/state/manifest.ocdbt"]
    assert store.rank_manifest(JOB, 3, 0) is None
    assert not store.commit_if_complete(JOB, 3, nodes=1)
    assert (store.complete_steps(JOB), incomplete_steps(store)) == ([], [(3, 0)])
    assert store.retain(JOB, keep=2) == []  # nothing complete yet: an upload may be in progress

    upload_step(store, tmp_path, 7, ranks=1)
    step_dir, manifest = write_step(tmp_path / "src-9", 9, 0, files)
    store.upload_rank(RankUpload(JOB, 9, 0, step_dir, manifest))  # rank 1 of step 9 still uploading
    assert store.retain(JOB, keep=2) == [(3, 0)]
    assert (store.complete_steps(JOB), incomplete_steps(store)) == ([(7, 0)], [(9, 0)])
    assert not [n for n in backend.names() if n.startswith(f"{JOB}/steps/3/")]


def test_dedup_stores_identical_files_of_data_parallel_peers_once(backend, tmp_path):
    store = backend.store
    shared = {"state/d/big": os.urandom(9 * MiB), "_CHECKPOINT_METADATA": b'{"step": 4}'}
    sources = {
        rank: {
            **shared,
            f"state/ocdbt.process_{rank}/d/x": os.urandom(1000),
            "state/manifest.ocdbt": with_crc32c_footer(os.urandom(60)),
        }
        for rank in range(2)
    }
    first = store.upload_rank(RankUpload(JOB, 4, 0, *write_step(tmp_path / "src-0", 4, 0, sources[0])))
    # Like real OCDBT files, both end with their own CRC32C: same path, size and CRC32C, other bytes.
    assert (
        first.files["state/manifest.ocdbt"].crc32c
        == build_manifest(str(tmp_path / "src-0"), 4, 0).files["state/manifest.ocdbt"][1]
    )
    peer = store.rank_manifest(JOB, 4, 0)
    assert peer == first
    second = store.upload_rank(
        RankUpload(JOB, 4, 1, *write_step(tmp_path / "src-1", 4, 1, sources[1]), dedup_from=peer)
    )
    assert store.commit_if_complete(JOB, 4, nodes=2)

    steps = f"{JOB}/steps/4/"
    assert backend.names() == [
        steps + n
        for n in [
            "COMMIT",
            "rank-0.manifest.json",
            "rank-0/_CHECKPOINT_METADATA",
            "rank-0/state/d/big",
            "rank-0/state/manifest.ocdbt",
            "rank-0/state/ocdbt.process_0/d/x",
            "rank-1.manifest.json",
            "rank-1/state/manifest.ocdbt",
            "rank-1/state/ocdbt.process_1/d/x",
        ]
    ]
    assert second.files["state/d/big"].object == "rank-0/state/d/big"
    assert second.files["state/manifest.ocdbt"].object == "rank-1/state/manifest.ocdbt"  # same path, other bytes
    store.download_rank(JOB, 4, 1, str(tmp_path / "restored-1"))
    assert read_tree(tmp_path / "restored-1") == sources[1]

    with pytest.raises(ValueError, match="shared within a step"):
        store.upload_rank(RankUpload(JOB, 5, 1, *write_step(tmp_path / "src-5", 5, 1, sources[1]), dedup_from=peer))


def test_progress_counts_each_file_as_it_is_stored_and_each_range_as_it_lands(backend, tmp_path):
    # What the in-flight gauges add up (BACKUP_IN_FLIGHT, RESTORE_IN_FLIGHT): every byte once, a call per file or range.
    store = backend.store
    shared = {"state/d/big": os.urandom(9 * MiB), "_CHECKPOINT_METADATA": b'{"step": 4}', "commit_success.txt": b""}
    sources = {rank: {**shared, f"state/ocdbt.process_{rank}/d/x": os.urandom(1000)} for rank in range(2)}
    stored: dict[int, list[int]] = {0: [], 1: []}
    first = store.upload_rank(
        RankUpload(JOB, 4, 0, *write_step(tmp_path / "src-0", 4, 0, sources[0]), on_file=stored[0].append)
    )
    store.upload_rank(
        RankUpload(
            JOB, 4, 1, *write_step(tmp_path / "src-1", 4, 1, sources[1]), dedup_from=first, on_file=stored[1].append
        )
    )
    for rank in range(2):  # rank 1's shared files count at once, as deduplicated
        assert sorted(stored[rank]) == sorted(len(data) for data in sources[rank].values())
    assert store.commit_if_complete(JOB, 4, nodes=2)
    fetched: list[int] = []
    store.download_rank(JOB, 4, 1, str(tmp_path / "restored-1"), on_range=fetched.append)
    assert sorted(fetched) == sorted(len(data) for data in sources[1].values() if data)  # one range each below 32 MiB
    assert read_tree(tmp_path / "restored-1") == sources[1]


def test_identical_ranks_share_an_upload_each_sending_its_share_and_commit_waits_for_every_rank(backend, tmp_path):
    store, members = backend.store, (0, 1, 2)
    shared = {f"state/d/chunk-{i}": os.urandom(64 * 1024) for i in range(12)}
    sources = {rank: {**shared, f"state/ocdbt.process_{rank}/d/x": os.urandom(1000)} for rank in members}
    steps = {rank: write_step(tmp_path / f"src-{rank}", 4, rank, sources[rank]) for rank in members}
    owners = {rel: shared_upload.owner(members, rel) for rel in shared}
    assert set(owners.values()) == set(members)  # every member sends a part

    assert (
        shared_upload.group_dedup(store, RankUpload(JOB, 4, 0, *steps[0], incarnation="inc"), members) is None
    )  # its share only: the others' are not there
    assert shared_upload.group_dedup(store, RankUpload(JOB, 4, 1, *steps[1], incarnation="inc"), members) is None
    dedup = shared_upload.group_dedup(store, RankUpload(JOB, 4, 2, *steps[2], incarnation="inc"), members)
    # The union of the shares: every file of a member that falls to that member (a rank's own path may too).
    union = {rel: f"rank-{r}/{rel}" for r in members for rel in sources[r] if shared_upload.owner(members, rel) == r}
    assert {rel: f.object for rel, f in dedup.files.items()} == union and set(shared) <= set(union)
    store.upload_rank(RankUpload(JOB, 4, 2, *steps[2], dedup_from=dedup, incarnation="inc"))
    assert not store.commit_if_complete(JOB, 4, nodes=3, incarnation="inc")  # ranks 0 and 1 have no full manifest yet
    for rank in (0, 1):
        store.upload_rank(
            RankUpload(
                JOB,
                4,
                rank,
                *steps[rank],
                dedup_from=shared_upload.group_dedup(
                    store, RankUpload(JOB, 4, rank, *steps[rank], incarnation="inc"), members
                ),
                incarnation="inc",
            )
        )
    assert store.commit_if_complete(JOB, 4, nodes=3, incarnation="inc")

    prefix = f"{JOB}/steps/4/"
    data = [n for n in backend.names() if n.startswith(prefix + "rank-") and "/" in n[len(prefix) :]]
    # Each shared file once, by its owner; each rank's own file by itself.
    assert sorted(data) == sorted(
        [prefix + f"rank-{o}/{rel}" for rel, o in owners.items()]
        + [prefix + f"rank-{r}/state/ocdbt.process_{r}/d/x" for r in members]
    )
    for rank in members:
        store.download_rank(JOB, 4, rank, str(tmp_path / f"restored-{rank}"))
        assert read_tree(tmp_path / f"restored-{rank}") == sources[rank]


def test_dedup_against_a_rank_manifest_written_before_blake3_compares_sha256(backend, tmp_path):
    store = backend.store
    shared = {"state/d/big": os.urandom(9 * MiB)}
    first = store.upload_rank(
        RankUpload(JOB, 4, 0, *write_step(tmp_path / "src-0", 4, 0, {**shared, "own": b"rank 0"}))
    )
    assert first.files["state/d/big"].identity == "blake3:" + blake3.blake3(shared["state/d/big"]).hexdigest()
    # The rank manifest as an agent before BLAKE3 wrote it: a "sha256" key with the bare hex digest.
    old = json.loads(first.to_json())
    for rel, stored in old["files"].items():
        del stored["identity"]
        stored["sha256"] = hashlib.sha256((tmp_path / "src-0" / rel).read_bytes()).hexdigest()
    peer = RankManifest.from_json(json.dumps(old))
    assert peer.files["state/d/big"].identity == "sha256:" + old["files"]["state/d/big"]["sha256"]

    second = store.upload_rank(
        RankUpload(
            JOB, 4, 1, *write_step(tmp_path / "src-1", 4, 1, {**shared, "own": b"rank 1", "new": b"x"}), dedup_from=peer
        )
    )
    assert second.files["state/d/big"].object == "rank-0/state/d/big"  # deduplicated through SHA-256
    assert second.files["own"] == dataclasses.replace(
        peer.files["own"],
        crc32c=second.files["own"].crc32c,
        object="rank-1/own",
        identity="sha256:" + hashlib.sha256(b"rank 1").hexdigest(),
    )
    assert (
        second.files["new"].identity == "blake3:" + blake3.blake3(b"x").hexdigest()
    )  # a path the peer lacks: today's scheme


def test_retain_keeps_newest_complete_steps_and_every_protected_one(backend, tmp_path):
    store = backend.store
    small = lambda rank: {"f": f"rank {rank}".encode()}  # noqa: E731
    for step in range(1, 6):
        upload_step(store, tmp_path, step, ranks=2, files=small)
    assert store.retain(JOB, keep=2, protected={1, 4}) == [(2, 0), (3, 0)]
    assert store.complete_steps(JOB) == [(1, 0), (4, 0), (5, 0)]
    assert {n.split("/")[3] for n in backend.names()} == {"1", "4", "5"}
    assert store.retain(JOB, keep=2, protected={1}) == []
    assert store.retain(JOB, keep=1) == [(1, 0), (4, 0)]
    assert store.complete_steps(JOB) == [(5, 0)]
    store.download_rank(JOB, 5, 1, str(tmp_path / "restored"))
    assert read_tree(tmp_path / "restored") == {"f": b"rank 1"}
    with pytest.raises(ValueError, match="keep"):
        store.retain(JOB, keep=0)


def test_timelines_are_stored_apart_and_retention_deletes_the_abandoned_one(backend, tmp_path):
    store = backend.store
    old = lambda rank: {"f": f"old timeline, rank {rank}".encode()}  # noqa: E731
    new = lambda rank: {"f": f"new timeline, rank {rank}".encode()}  # noqa: E731
    for step in (2, 4, 6):
        upload_step(store, tmp_path, step, ranks=2, files=old)
    # Rolled back to step 2 (timeline 1 begins): the new timeline writes step 4 again, apart.
    upload_step(store, tmp_path, 4, ranks=2, files=new, timeline=1)
    assert store.complete_steps(JOB) == [(2, 0), (4, 0), (4, 1), (6, 0)]
    assert {n.split("/")[3] for n in backend.names()} == {"2", "4", "4-t1", "6"}
    store.download_rank(JOB, 4, 1, str(tmp_path / "t1"), timeline=1)
    store.download_rank(JOB, 4, 1, str(tmp_path / "t0"))
    assert (read_tree(tmp_path / "t1"), read_tree(tmp_path / "t0")) == (new(1), old(1))
    assert store.rank_manifest(JOB, 4, 0, timeline=1).timeline == 1

    # Without the lineage nothing is known abandoned; with it, timeline 0's steps after 2 go, 2 stays.
    assert store.retain(JOB, keep=5) == []
    assert store.retain(JOB, keep=5, protected={4, 6}, forks=(2,)) == [(4, 0), (6, 0)]
    assert store.complete_steps(JOB) == [(2, 0), (4, 1)]
    with pytest.raises(ValueError):  # objects are shared within one step of one timeline only
        step_dir, manifest = write_step(tmp_path / "src-dedup", 4, 1, new(1))
        store.upload_rank(
            RankUpload(JOB, 4, 1, step_dir, manifest, dedup_from=store.rank_manifest(JOB, 2, 0), timeline=1)
        )


def test_manifest_naming_a_path_outside_the_step_is_refused(backend, tmp_path):
    store = backend.store
    steps = f"{JOB}/steps/6/"
    evil = {"step": 6, "rank": 0, "files": {"../../escape": {"size": 1, "crc32c": "00000000", "object": "rank-0/x"}}}
    assert store.objects.create_text(steps + "rank-0.manifest.json", json.dumps(evil))
    assert store.objects.create_text(steps + "COMMIT", json.dumps({"step": 6, "nodes": 1, "ranks": [0]}))
    (tmp_path / "dest").mkdir()
    with pytest.raises(BackupError, match="not a relative path"):
        store.download_rank(JOB, 6, 0, str(tmp_path / "dest" / "restored"))
    assert os.listdir(tmp_path / "dest") == [] and not (tmp_path / "escape").exists()


def test_open_backup_store_rejects_what_it_cannot_serve(tmp_path):
    for url in [
        "az://container/x",
        "gs:///no-bucket",
        "s3:///no-bucket",
        "s3://b/x?versionId=1",
        "file://host/path",
        "file:relative",
        "/plain/path",
    ]:
        with pytest.raises(ValueError):
            open_backup_store(url)
    with pytest.raises(ValueError, match="gs:// only"):
        open_backup_store(f"file://{tmp_path}", emulator_host="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="s3:// only"):
        open_backup_store("gs://bucket", s3_endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="job key"):
        open_backup_store(f"file://{tmp_path}").complete_steps(JobRef("Team_A", "llama"))


def test_interrupted_upload_is_swept_by_retention_once_a_newer_step_commits(backend, tmp_path):
    if backend.interrupt is None:
        pytest.skip("an interrupted GCS resumable upload is invisible and expires by itself")
    store = backend.store
    backend.interrupt(f"{JOB}/steps/3/rank-0/state/d/big")  # an agent killed mid-upload
    assert incomplete_steps(store) == [(3, 0)]
    assert store.retain(JOB, keep=1) == []  # nothing complete: it may still be uploading

    upload_step(store, tmp_path, 7, ranks=1)
    backend.interrupt(f"{JOB}/steps/9/rank-0/state/d/big")  # newer than the newest commit: may be in progress
    assert store.retain(JOB, keep=1) == [(3, 0)]
    assert [n.split("/")[3] for n in backend.partial()] == ["9"]
    assert (store.complete_steps(JOB), incomplete_steps(store)) == ([(7, 0)], [(9, 0)])


def test_commit_and_manifests_are_write_once_and_a_committed_step_is_never_overwritten(backend, tmp_path):
    store = backend.store
    sources = upload_step(store, tmp_path, 5, ranks=1)
    commit = store.objects.read_text(f"{JOB}/steps/5/COMMIT")
    assert not store.objects.create_text(f"{JOB}/steps/5/COMMIT", "{}")
    assert store.objects.read_text(f"{JOB}/steps/5/COMMIT") == commit
    assert store.commit_if_complete(JOB, 5, nodes=1)

    other_dir, other = write_step(tmp_path / "other", 5, 0, rank_files(0))  # other random bytes, same step
    with pytest.raises(BackupError, match="committed with other data"):
        store.upload_rank(RankUpload(JOB, 5, 0, other_dir, other))
    same_dir, same = write_step(tmp_path / "src-5-0", 5, 0, sources[0])  # a retried upload: accepted as is
    assert store.upload_rank(RankUpload(JOB, 5, 0, same_dir, same)) == store.rank_manifest(JOB, 5, 0)
    store.download_rank(JOB, 5, 0, str(tmp_path / "restored"))
    assert read_tree(tmp_path / "restored") == sources[0]

    # An uncommitted manifest left by another incarnation is replaced by the new upload of the step.
    store.upload_rank(RankUpload(JOB, 8, 0, *write_step(tmp_path / "old", 8, 0, {"f": b"old"}), incarnation="old"))
    assert not store.commit_if_complete(JOB, 8, nodes=1, incarnation="new")
    store.upload_rank(RankUpload(JOB, 8, 0, *write_step(tmp_path / "new", 8, 0, {"f": b"new"}), incarnation="new"))
    assert store.commit_if_complete(JOB, 8, nodes=1, incarnation="new")
    store.download_rank(JOB, 8, 0, str(tmp_path / "restored-8"))
    assert read_tree(tmp_path / "restored-8") == {"f": b"new"}


def test_minio_is_probed_as_crc32c_with_conditional_writes_and_multipart_objects_carry_the_manifest_crc32c(
    minio_module, monkeypatch, tmp_path
):
    for key, value in minio_module.client_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the endpoint given as --s3-endpoint-url is
    client = minio_module.client()
    client.create_bucket(Bucket="probe")
    store = open_backup_store("s3://probe/x", s3_endpoint_url=minio_module.url)
    assert store.objects.features() == S3Features(crc32c=True, conditional_writes=True)
    files = {"big": os.urandom(3 * PART_BYTES + 5), "small": b"abc"}
    step_dir, manifest = write_step(tmp_path / "src", 1, 0, files)
    store.upload_rank(RankUpload(JOB, 1, 0, step_dir, manifest))
    for rel, (size, crc) in manifest.files.items():
        head = client.head_object(Bucket="probe", Key=f"x/{JOB}/steps/1/rank-0/{rel}", ChecksumMode="ENABLED")
        assert (head["ContentLength"], head["ChecksumCRC32C"]) == (size, base64.b64encode(bytes.fromhex(crc)).decode())
        if size >= PART_BYTES:  # multipart: the whole file's CRC32C, not a CRC of the parts' CRCs
            assert head["ChecksumType"] == "FULL_OBJECT"
    assert client.list_objects_v2(Bucket="probe", Prefix="x/.mtc-probe").get("KeyCount") == 0  # the probe cleans up


def test_s3_without_credentials_is_refused_when_opened(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata off loopback
    with pytest.raises(BackupError, match="no credentials"):
        open_backup_store("s3://bucket/x")


def test_a_reference_stands_in_for_a_rank_with_its_peers_objects_and_never_over_a_committed_step(tmp_path):
    """``shared_upload.reference``: a lost rank's manifest names its data-parallel peer's objects (the same bytes),
    nothing is uploaded, the step commits under the backup's tag and restores the peer's bytes, checked."""
    store = open_backup_store(f"file://{tmp_path / 'objects'}")
    same = rank_files(1)
    step_dir, manifest = write_step(tmp_path / "src-1", 5, 1, same)
    source = store.upload_rank(RankUpload(JOB, 5, 1, step_dir, manifest, incarnation="tag"))

    stood_in = shared_upload.reference(store, JOB, 0, source)
    assert (stood_in.rank, stood_in.incarnation, stood_in.files) == (0, "tag", source.files)
    assert {f.object.split("/")[0] for f in stood_in.files.values()} == {"rank-1"}
    assert not (tmp_path / "objects" / JOB.namespace / JOB.job / "steps" / "5" / "rank-0").exists()  # nothing uploaded
    assert shared_upload.reference(store, JOB, 0, source) == store.rank_manifest(JOB, 5, 0) == stood_in
    assert store.commit_if_complete(JOB, 5, nodes=2, incarnation="tag")
    restored = store.download_rank(JOB, 5, 0, str(tmp_path / "restored-0"))
    assert read_tree(tmp_path / "restored-0") == same and restored == StepManifest(5, 0, manifest.files)

    # Another backup's tag over the committed step: refused, the committed manifest left as it is.
    with pytest.raises(BackupError, match="committed with other data"):
        shared_upload.reference(store, JOB, 0, dataclasses.replace(source, incarnation="other"))
    assert store.rank_manifest(JOB, 5, 0) == stood_in
