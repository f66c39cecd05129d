"""The CRC-32C of a step's files (``replicator/local_tier/step_manifest.py``): a file checksummed in pieces on
threads, and two CRCs combined, each equal to the CRC of the whole bytes."""

import contextlib
import os

import google_crc32c

from replicator.local_tier.step_manifest import checksum_files, crc32c_combine
from tests.helpers.steps import write_tree


def test_checksum_files_in_pieces_on_threads_equals_the_crc_of_each_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr("replicator.local_tier.step_manifest._PIECE_BYTES", 1 << 20)
    contents = {"big": os.urandom((5 << 20) + 17), "small": b"abc", "empty": b""}
    write_tree(str(tmp_path), contents)
    with contextlib.ExitStack() as opened:
        files = [(rel, opened.enter_context(open(tmp_path / rel, "rb")).fileno()) for rel in contents]
        sums = checksum_files(files, workers=3)
    assert sums == {rel: (len(data), f"{google_crc32c.value(data):08x}") for rel, data in contents.items()}


def test_crc32c_combine_equals_the_crc_of_the_concatenation():
    pairs = [
        (b"", b""),
        (b"a", b""),
        (b"", b"b"),
        (os.urandom(1000), os.urandom(70_001)),
        (os.urandom(3), os.urandom(1 << 20)),
    ]
    for first, second in pairs:
        combined = crc32c_combine(google_crc32c.value(first), google_crc32c.value(second), len(second))
        assert combined == google_crc32c.value(first + second)
