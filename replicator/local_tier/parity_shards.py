"""The parity shards a node holds for a job (``replicator.parity``), beside the job's replicas::

    mtc/parity/<step>/g<first member>-s<stripe>          the shard's bytes
    mtc/parity/<step>/g<first member>-s<stripe>.json     its ``ShardMeta``, written after the bytes are in place

A group is named by its first member rank (groups of one incarnation are disjoint). A node holds at most one
shard of a stripe. A shard without its JSON was never complete and is swept.
"""

import contextlib
import os
import re
import shutil

import msgspec

from replicator.local_tier import pod_files
from replicator.local_tier.job_meta import META_DIR
from replicator.wire.messages import HeldShard, JobRef, ParityShard

_SHARD_NAME = re.compile(r"^g(\d+)-s(\d+)$")
_MAX_META_BYTES = 1 << 20


class ShardMeta(ParityShard, frozen=True, gc=False, kw_only=True):
    """A parity shard as its ramdisk keeps it (the shard's ``.json``), built by keyword.

    Attributes:
      stream_bytes: each member's stream length when encoded, bytes, position order.
    """

    stream_bytes: tuple[int, ...]

    def held(self, job: JobRef) -> HeldShard:
        """What a node's report says of the shard (``NodeReport.shards``)."""
        shared = {field: getattr(self, field) for field in ParityShard.__struct_fields__}
        return HeldShard(namespace=job.namespace, job=job.job, **shared)


class ParityShards:
    """A job ramdisk's parity shards (``ramdisk_path``: the ramdisk's mount point)."""

    def __init__(self, ramdisk_path: str):
        self._root = os.path.join(ramdisk_path, META_DIR, "parity")

    def path(self, step: int, group: int, stripe: int) -> str:
        return os.path.join(self._root, str(step), f"g{group}-s{stripe}")

    def install(self, written: str, meta: ShardMeta) -> None:
        """Moves a written, checksummed shard file into place; its JSON goes last."""
        target = self.path(meta.step, meta.members[0], meta.stripe)
        self.drop(meta.step, meta.members[0], meta.stripe)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(written, target)
        pod_files.write_file_atomic(target + ".json", msgspec.json.encode(meta))

    def drop(self, step: int, group: int, stripe: int) -> None:
        target = self.path(step, group, stripe)
        for name in (target + ".json", target):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def held(self) -> list[ShardMeta]:
        """Every complete shard, by step."""
        found = []
        for step_name in _listdir(self._root):
            directory = os.path.join(self._root, step_name)
            for name in _listdir(directory):
                if _SHARD_NAME.match(name) and (meta := self._read_meta(os.path.join(directory, name))) is not None:
                    found.append(meta)
        return sorted(found, key=lambda m: (m.step, m.members[0], m.stripe))

    def meta(self, step: int, group: int, stripe: int) -> ShardMeta | None:
        return self._read_meta(self.path(step, group, stripe))

    def total_bytes(self) -> int:
        return sum(m.bytes for m in self.held())

    def drop_older(self, keep_from: int, keep: set[int]) -> int:
        """Deletes the shards of steps older than ``keep_from`` not in ``keep``, and incomplete shards;
        returns how many complete shards went."""
        dropped = 0
        for step_name in _listdir(self._root):
            directory = os.path.join(self._root, step_name)
            if not step_name.isdigit():
                continue
            step = int(step_name)
            if step < keep_from and step not in keep:
                dropped += sum(1 for n in _listdir(directory) if n.endswith(".json"))
                shutil.rmtree(directory, ignore_errors=True)
                continue
            for name in _listdir(directory):  # bytes whose JSON never came: an encode cut short
                if _SHARD_NAME.match(name) and not os.path.exists(os.path.join(directory, name + ".json")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(directory, name))
        return dropped

    @staticmethod
    def _read_meta(shard_path: str) -> ShardMeta | None:
        try:
            with open(shard_path + ".json", "rb") as f:
                data = f.read(_MAX_META_BYTES)
            meta = msgspec.json.decode(data, type=ShardMeta)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return meta if os.path.exists(shard_path) else None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
