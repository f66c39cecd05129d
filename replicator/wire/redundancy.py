"""A job's redundancy: how its RAM copies survive a node loss.

- ``replicas``: full copies on ``--replicas`` peers (1 or 2): ``1 + replicas`` of the checkpoint in cluster RAM.
- ``xor:N``: ranks in groups of N nodes, one parity shard per stripe (survives one loss per group):
  ``N/(N-1)``.
- ``rs:N:K``: groups of N, K Reed-Solomon parity shards per stripe (survives K losses per group): ``1 + K/(N-K)``.

Only ranks without a data-parallel peer are encoded (``assume-data-parallelism`` peers are already copies).
A job's ``replicator.yaml`` may set it (``redundancy``); otherwise the agents' ``--redundancy`` does.
"""

import dataclasses
import hashlib
import re
from collections.abc import Mapping

import msgspec

from replicator.wire.messages import JobSettings

_FORM = re.compile(r"^(?:replicas|xor:(?P<xn>[0-9]{1,3})|rs:(?P<rn>[0-9]{1,3}):(?P<rk>[0-9]{1,2}))$")
MAX_GROUP = 64


@dataclasses.dataclass(frozen=True)
class Redundancy:
    """A parsed setting. ``group`` and ``parity`` are 0 for full replicas."""

    group: int = 0
    parity: int = 0

    @property
    def encoded(self) -> bool:
        return self.parity > 0

    def __str__(self) -> str:
        if not self.encoded:
            return "replicas"
        return f"xor:{self.group}" if self.parity == 1 else f"rs:{self.group}:{self.parity}"


REPLICAS = Redundancy()


def parse(text: str) -> Redundancy:
    """Parses ``replicas``, ``xor:N`` or ``rs:N:K``.

    Raises:
      ValueError: another form, a group outside 2..64, or K not in 1..N-1.
    """
    match = _FORM.match(text.strip())
    if match is None:
        raise ValueError(f"redundancy {text!r}: expected replicas, xor:<group> or rs:<group>:<parity>")
    if match["xn"] is None and match["rn"] is None:
        return REPLICAS
    group, parity = (int(match["xn"]), 1) if match["xn"] is not None else (int(match["rn"]), int(match["rk"]))
    if not 2 <= group <= MAX_GROUP:
        raise ValueError(f"redundancy {text!r}: a group has 2 to {MAX_GROUP} nodes")
    if not 1 <= parity < group:
        raise ValueError(f"redundancy {text!r}: parity shards per stripe must be 1 to {group - 1}")
    return Redundancy(group, parity)


def of_job(settings: JobSettings | None, chosen: frozenset[str]) -> Redundancy:
    """The job's setting: ``settings``' (the ``replicator.yaml`` of the lowest rank that has one), else its nodes'
    common ``--redundancy`` (``chosen``: the values its nodes report); full replicas when the nodes disagree (the
    setting that needs nothing of the others)."""
    if settings is not None and settings.redundancy is not None:
        return _parsed(settings.redundancy)
    return _parsed(next(iter(chosen))) if len(chosen) == 1 else REPLICAS


def _parsed(text: str) -> Redundancy:
    """``parse``, full replicas for a setting the wire's pattern let through but ``parse`` refuses (``xor:1``):
    the agents refuse it where it is set, with its error."""
    try:
        return parse(text)
    except ValueError:
        return REPLICAS


def files_digest(files: Mapping[str, tuple[int, str]]) -> str:
    """A member's step as parity sees it: SHA-256 hex of its checksums (path -> (size, CRC-32C)), paths sorted.
    The coordinator names each member's in an encode order; the encoding agent checks the manifest it reads."""
    return hashlib.sha256(msgspec.json.encode(dict(files), order="sorted")).hexdigest()


def basis(digests: tuple[str, ...]) -> str:
    """What a group's parity shards of a step were built over: SHA-256 hex of its members' ``files_digest``s in
    position order. Shards count (safety, decoding) only while it is the members' current checksums' basis: a
    rewritten step or a rolled-back timeline gets other checksums, and its old shards stop counting."""
    return hashlib.sha256(",".join(digests).encode()).hexdigest()
