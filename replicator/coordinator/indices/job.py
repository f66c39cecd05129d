"""One job as the coordinator knows it: its domain data, with its indices, decisions and memo caches
each in a small object of its own.

- domain data (``JobState``): pods, incarnation, settings, lineage, the operator's rollback, backups;
- indices: ``claims`` (``claims.ClaimIndex``), ``beliefs`` (``claims.Beliefs``), ``owners``
  (``OwnerReports``), ``identical_ranks`` (``identical_ranks.Identity``), ``parity_orders`` (``parity_orders.ParityOrders``);
- the decision pass's cached results: ``decided`` (``Decisions``);
- memo caches with their stamps: ``memo`` (``Memos``).
"""

import dataclasses
import zlib
from typing import NamedTuple

import msgspec

from replicator.coordinator.indices.claims import Beliefs, ClaimIndex, HeldMemo
from replicator.coordinator.indices.identical_ranks import Identity, LeaderMemo
from replicator.coordinator.indices.incarnations import Incarnation
from replicator.coordinator.indices.parity_orders import ParityOrders
from replicator.wire.messages import (
    BackedUp,
    Files,
    JobSettings,
    PodReport,
    RetainOrder,
)
from replicator.wire.redundancy import REPLICAS, Redundancy

# Checksums are kept packed: one JSON blob of a step's manifest, keys sorted, so that two equal
# manifests pack to equal bytes, compressed. As decoded dicts, 60 files x 3 steps were 45 KB of the
# 57 KB a node cost the coordinator (2026-11-25, ``tests.bench.coordinator_sim``); as JSON, about 13 KB.
# zlib (level 1: the fastest, and within 2 % of level 6's size here) takes a 60-file manifest with
# Orbax's random data-file names from 4.6 to 2.0 KB, for about 25 us more to pack and 15 us more to unpack.
_FILES_DECODER = msgspec.json.Decoder(dict[str, tuple[int, str]])
_ZLIB_LEVEL = 1


class StandIn(NamedTuple):
    """Who uploads a rank of the pending backup in its node's place (``backups.stand_ins``).

    Attributes:
      node: the node that uploads.
      peer: None when ``node`` holds the rank's replica; else the rank's data-parallel peer whose own copy of the step
        ``node`` holds, with the rank's checksums: ``node`` stores the rank's manifest naming the peer's objects.
    """

    node: str
    peer: int | None = None


def pack_files(files: Files) -> bytes:
    """A step's checksums (path -> (size, CRC32C)) as bytes; equal manifests give equal bytes."""
    return zlib.compress(msgspec.json.encode(files, order="sorted"), _ZLIB_LEVEL)


def unpack_files(packed: bytes) -> Files:
    """``pack_files``'s checksums again (path -> (size, CRC32C)), the paths in sorted order."""
    return _FILES_DECODER.decode(zlib.decompress(packed))


class OwnerReports:
    """What each rank's own node reported of its data.

    Attributes:
      files: (step, rank) -> the checksums the rank's own node reported, packed (``pack_files``):
        what every copy restored for that rank must match, whoever serves it.
      pending: (step, rank, node) -> (packed checksums, signature) a node reported for its own data,
        until the node is believed for the rank (then they become ``files`` and the identity's signatures).
      step_stamps: step -> a stamp taken anew whenever ``files`` of the step change (never reused, also
        after the step is forgotten): what ``parity.place_orders`` remembers its work by.
      recovered: (step, rank) -> packed checksums a previous coordinator kept in its state dir
        (``recovery``): a lost rank's, which no report brings back. Served by ``checksums`` until the rank's own
        believed node reports its own (then ``files``, which win).
    """

    __slots__ = ("_stamp", "files", "pending", "recovered", "step_stamps")

    def __init__(self) -> None:
        self.files: dict[tuple[int, int], bytes] = {}
        self.pending: dict[tuple[int, int, str], tuple[bytes | None, str | None]] = {}
        self.recovered: dict[tuple[int, int], bytes] = {}
        self.step_stamps: dict[int, int] = {}
        self._stamp = 0

    def _changed(self, step: int) -> None:
        self._stamp += 1
        self.step_stamps[step] = self._stamp

    def drop(self, step: int, rank: int) -> None:
        """Forgets the rank's checksums of ``step`` (the step was written again)."""
        recovered = self.recovered.pop((step, rank), None)
        if self.files.pop((step, rank), None) is not None or recovered is not None:
            self._changed(step)

    def recover(self, step: int, rank: int, packed: bytes) -> None:
        """A previous coordinator's checksums of the rank's ``step`` (``pack_files``), kept until its own report."""
        if (step, rank) not in self.files:
            self.recovered[(step, rank)] = packed
            self._changed(step)

    def known(self, step: int, rank: int) -> bytes | None:
        """The rank's packed checksums of ``step``: reported to this coordinator, else recovered; or None."""
        return self.files.get((step, rank)) or self.recovered.get((step, rank))

    def promote(self, beliefs: Beliefs, identity: Identity) -> None:
        """Checksums and signatures reported by nodes now believed for the rank become the job's."""
        for (step, rank, node_id), (files, signature) in list(self.pending.items()):
            if not beliefs.believed(node_id, step, rank, False):
                continue
            if files is not None and (step, rank) not in self.files:
                self.files[(step, rank)] = files
                self.recovered.pop((step, rank), None)  # the rank's own word wins over what was kept
                self._changed(step)
            if signature is not None:
                identity.add_signature(step, rank, signature)
            if files is not None or (step, rank) in self.files:
                del self.pending[(step, rank, node_id)]

    def checksums(self, step: int, rank: int) -> Files | None:
        """The checksums the rank's own node reported for ``step`` (path -> (size, CRC32C)), or None."""
        packed = self.known(step, rank)
        return unpack_files(packed) if packed is not None else None

    def forget_above(self, lowest: int) -> None:
        for table in (self.files, self.recovered):
            for files_key in [k for k in table if k[0] > lowest]:
                del table[files_key]
        for pending_key in [k for k in self.pending if k[0] > lowest]:
            del self.pending[pending_key]
        self.step_stamps = {s: stamp for s, stamp in self.step_stamps.items() if s <= lowest}

    def forget_gone(self, steps: frozenset[int]) -> None:
        for table in (self.files, self.recovered):
            for key in [k for k in table if k[0] not in steps]:
                del table[key]
        self.step_stamps = {s: stamp for s, stamp in self.step_stamps.items() if s in steps}


@dataclasses.dataclass
class Decisions:
    """The decision pass's results, cached for replies (see ``ClusterState.decide``).

    Attributes:
      dirty: something changed since the last pass; decided_at: unix seconds of the last pass.
      version: bumped whenever assignments or restore views may have changed (long polls wake).
      safe: the newest step GC may keep from (``retention.safe_step``); retain: its order.
      targets: rank -> replica target nodes (``replicas.place``); lister: the node that lists backups.
      round: the step every rank replicates now (``replicas.choose_round``), or None.
      redundancy: the job's setting (``parity.job_setting``) as of the last pass.
    """

    dirty: bool = True
    decided_at: float = float("-inf")
    version: int = 0
    safe: int | None = None
    retain: RetainOrder | None = None
    targets: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    lister: str | None = None
    round: int | None = None
    redundancy: Redundancy = REPLICAS


@dataclasses.dataclass
class Memos:
    """Memo caches and the stamps they hold for.

    Attributes:
      held: ``walk_ranks``'s answers (``claims.HeldMemo``).
      leaders: backup leaders at one step (``identity.LeaderMemo``).
      targets_for: (incarnation id, replicas) ``Decisions.targets`` were chosen for...
      ordered_for: ...and were added to the beliefs' ``ordered`` for.
      replicas: the replicas the incarnation's nodes are configured for, as of ``replicas_for``:
        (incarnation id, ``Liveness.replicas_epoch``).
      redundancy: the ``--redundancy`` settings the incarnation's nodes report, as of ``redundancy_for``:
        (incarnation id, ``Liveness.redundancy_epoch``).
      known_steps: the steps held in any tier at the last sweep (tables are swept on a change).
      round_for: the incarnation id ``Decisions.round`` was chosen in.
      groups: the parity groups (``parity.groups``), chosen for ``groups_for``: (incarnation id, setting, ranks);
        group_of: rank -> its group.
      placed_for: (``groups_for``, the round's step, its ``OwnerReports.step_stamps``) the round's parity orders
        were last placed for (``parity.place_orders``).
      stranded: ((step, its claims' stamp, incarnation id), the answer) of ``backups.stranded_ranks``'s last walk.
    """

    held: HeldMemo = dataclasses.field(default_factory=HeldMemo)
    leaders: LeaderMemo = dataclasses.field(default_factory=LeaderMemo)
    targets_for: tuple[str, int] | None = None
    ordered_for: tuple[str, int] | None = None
    replicas: int = 1
    replicas_for: tuple[str, int] | None = None
    redundancy: frozenset[str] = frozenset()
    redundancy_for: tuple[str, int] | None = None
    known_steps: frozenset[int] = frozenset()
    round_for: str | None = None
    groups: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    groups_for: tuple[str, str, tuple[int, ...]] | None = None
    group_of: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    placed_for: tuple[object, ...] | None = None
    stranded: tuple[tuple[object, ...], tuple[int, ...]] | None = None


@dataclasses.dataclass
class JobState:
    """A job's domain data, its indices, decisions and memo caches.

    Attributes:
      pods: pod uid -> (its report, its node), for the pods published on every known node.
      pods_changed: a pod was published, changed or unpublished since the last decision pass.
      retired_pods: pods of incarnations that ended and are still published; they never join another one.
      incarnation: the current set of pods and their ranks, or None.
      nodes: ranks of the newest incarnation: known after its pods are gone (``restore-from``).
      settings: rank -> its ``replicator.yaml`` settings.
      forks: the job's rollbacks (``messages.in_lineage``): only copies of its lineage are indexed.
      forced_step: a step an operator asked the next restore to use (``mtc restore-from``).
      forked: the timeline for ``forced_step`` has begun (once per request, however often it is planned).
      listings: node -> its last listing of the job's backups.
      backup_pending: the step being backed up now (since ``backup_pending_since``), or None.
      backup_attempt: the tag its uploads carry (``BackupOrder.incarnation``): the id of the incarnation that chose
        it and a random suffix, one per choice, kept through later incarnations, so ranks uploaded before a
        preemption count toward its ``COMMIT``. A pending step's bytes never change (a rank that holds it in other
        bytes drops it, ``sync._supersede``), and a later choice of a step has a tag of its own: ``COMMIT`` never
        joins two choices' uploads.
      backup_stand_ins: rank -> who uploads the pending backup's copy of that rank in its place (the rank's node was
        lost mid-backup and its fresh node holds no copy; the stand-in holds a replica, or a data-parallel peer's own
        copy in the same bytes): ``backups.stand_ins``, chosen again in every decision pass.
      last_backup_time: unix seconds the last backup completed (``mtc_last_backup_timestamp_seconds``).
      last_backup_chosen_at: unix seconds the last completed backup was chosen: ``backup-interval-minutes`` counts
        from it, so a backup's upload time is not added to the interval (the lag stays within one interval plus one
        upload).
      backup_seen: step -> unix seconds this coordinator first saw each complete backup of the
        lineage (``backups.note_seen``; the backup tier's listings carry no commit times).
      rewritten: steps some rank's own node holds in other bytes than it first reported (written again after a
        restore to an older step, or restored from a data-parallel peer's other bytes): never backed up, as that
        rank's copy is not the one it wrote (a whole-cluster restore would hand it a peer's files).
      safe_at: safe step -> unix seconds this coordinator first found it safe, for the safe steps newer than the
        newest backup (``backups.lag``).
    """

    pods: dict[str, tuple[PodReport, str]] = dataclasses.field(default_factory=dict)
    pods_changed: bool = True
    retired_pods: set[str] = dataclasses.field(default_factory=set)
    incarnation: Incarnation | None = None
    nodes: int = 0
    settings: dict[int, JobSettings] = dataclasses.field(default_factory=dict)
    forks: tuple[int, ...] = ()
    forced_step: int | None = None
    forked: bool = False
    listings: dict[str, BackedUp] = dataclasses.field(default_factory=dict)
    backup_pending: int | None = None
    backup_pending_since: float = 0.0
    backup_attempt: str = ""
    backup_stand_ins: dict[int, StandIn] = dataclasses.field(default_factory=dict)
    last_backup_time: float | None = None
    last_backup_chosen_at: float | None = None
    backup_seen: dict[int, float] = dataclasses.field(default_factory=dict)
    rewritten: set[int] = dataclasses.field(default_factory=set)
    safe_at: dict[int, float] = dataclasses.field(default_factory=dict)
    claims: ClaimIndex = dataclasses.field(default_factory=ClaimIndex)
    beliefs: Beliefs = dataclasses.field(default_factory=Beliefs)
    owners: OwnerReports = dataclasses.field(default_factory=OwnerReports)
    identity: Identity = dataclasses.field(default_factory=Identity)
    parity_orders: ParityOrders = dataclasses.field(default_factory=ParityOrders)
    decided: Decisions = dataclasses.field(default_factory=Decisions)
    memo: Memos = dataclasses.field(default_factory=Memos)

    def add_settings(self, rank: int, settings: JobSettings) -> None:
        """Records a rank's settings (and its data-parallel peers); the job is to be decided again."""
        self.settings[rank] = settings
        self.identity.add_peers(rank, settings)
        self.decided.dirty = True

    def ranks(self) -> int:
        """The job's rank count: its incarnation's, else its pods' shape, else the last incarnation's."""
        if self.incarnation:
            return len(self.incarnation.node_of_rank)
        if self.pods:
            return next(iter(self.pods.values()))[0].nodes
        return self.nodes

    def drop_claim(self, step: int, rank: int, node_id: str) -> None:
        """The node's claim to (step, rank) is gone: from the index, and from the copies kept believed from an
        earlier incarnation (claimed again, it counts only if the current incarnation vouches for it)."""
        self.claims.drop(step, rank, node_id)
        self.beliefs.drop(step, rank, node_id)

    def pending_rollback(self) -> int | None:
        """``forced_step`` while its restore is not planned: cancellable, nothing abandoned for it yet."""
        return self.forced_step if not self.forked else None

    def may_form(self) -> bool:
        """Whether a job without an incarnation may have a new pod for every rank since its last pass:
        then it is decided at once, not at its paced interval, for every pod's long poll waits on it.
        ``retired_pods`` is a subset of ``pods`` (a pod leaves both when it is gone), so the count is
        an upper bound of the new pods: at worst a pass runs early."""
        if self.incarnation is not None or not self.pods_changed or not self.pods:
            return False
        return len(self.pods) - len(self.retired_pods) >= next(iter(self.pods.values()))[0].nodes

    def forget_gone_steps(self, steps: frozenset[int]) -> None:
        """Checksums, signatures, identities and parity orders of steps not in ``steps`` (held in no tier)."""
        if steps == self.memo.known_steps:
            return  # the tables hold only steps that were held at the last sweep
        self.memo.known_steps = steps
        self.owners.forget_gone(steps)
        self.identity.forget_gone(steps)
        self.parity_orders.forget_steps(steps.__contains__)
        self.rewritten &= steps
        self.claims.sweep_stamps()
        self.memo.held.sweep(self.claims.step_stamps)
