"""The coordinator keeps each rank's owner checksums packed (``job.pack_files``): equal manifests pack to
equal bytes whatever the order of their paths, unpack to what was reported, and take less than half of
their JSON for an Orbax-like step of random data-file names."""

import os

import msgspec

from replicator.coordinator.indices.job import pack_files, unpack_files


def orbax_like_manifest(files: int = 60) -> dict[str, tuple[int, str]]:
    manifest = {
        "_CHECKPOINT_METADATA": (256, "a9e7ef50"),
        "state/_METADATA": (2048, "21c6dfca"),
        "state/manifest.ocdbt": (512, "0f0e0d0c"),
    }
    for _ in range(files - len(manifest)):
        manifest[f"state/ocdbt.process_0/d/{os.urandom(16).hex()}"] = (
            int.from_bytes(os.urandom(3), "big"),
            os.urandom(4).hex(),
        )
    return manifest


def test_equal_manifests_pack_to_equal_bytes_and_unpack_to_the_report():
    manifest = orbax_like_manifest()
    reordered = dict(reversed(manifest.items()))
    assert pack_files(manifest) == pack_files(reordered)
    assert unpack_files(pack_files(reordered)) == manifest
    assert list(unpack_files(pack_files(reordered))) == sorted(manifest)
    changed = {**manifest, "state/_METADATA": (2048, "00000000")}
    assert pack_files(changed) != pack_files(manifest)


def test_a_packed_manifest_takes_less_than_half_its_json():
    manifest = orbax_like_manifest()
    assert len(pack_files(manifest)) < len(msgspec.json.encode(manifest)) / 2
