"""JSON messages between node agents and the coordinator: msgspec structs, decoded and validated at the edge.

The format is versioned (``PROTOCOL_VERSION``): agents and coordinators of adjacent versions work together
(a rolling upgrade); further apart they refuse each other's messages with an error naming both versions,
never half-understand them.

``decode`` turns a body into a typed message or raises ``ValueError`` naming the bad field (msgspec's
``... - at `$.held[3].files```), so a handler answers 400. Every list, map and string is bounded,
so a report can neither exhaust the coordinator nor make it loop over an invented ``nodes``.
"""

import enum
import hashlib
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec

# Bounds of one message. A node holds a few jobs with a few steps each; Orbax steps hold tens of files.
MAX_PODS = 1_024
MAX_HELD = 16_384
MAX_FILES = 100_000
MAX_RANKS = 100_000
MAX_LIST = 1_024
MAX_NOTICES = 16
MAX_NOTICE_CHARS = 1_024
"""Notices in one report, at most: a node's are rare (a refusal, a full ramdisk, a store fault)."""
NOTICE_REASONS = ("VolumeRefused", "RamdiskNearlyFull", "BackupStoreUnusable")
"""The Event reasons a node may ask for (CamelCase, as Kubernetes' reasons are); the coordinator drops any other
(not refused in decoding: a newer agent's reason must not fail its whole report)."""
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
Text = Annotated[str, msgspec.Meta(max_length=4_096)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
Step = Annotated[int, msgspec.Meta(ge=0, lt=(1 << 63) - 1)]
# Timeline t of a job: the steps written after its t-th rollback (``mtc restore-from``); 0 before any.
Timeline = Annotated[int, msgspec.Meta(ge=0, le=MAX_LIST)]
Forks = Annotated[tuple[Step, ...], msgspec.Meta(max_length=MAX_LIST)]
FileEntry = tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{8}$")]]
# A job's redundancy (``replicator.wire.redundancy``): ``replicas``, ``xor:<group>`` or ``rs:<group>:<parity>``.
RedundancyText = Annotated[str, msgspec.Meta(pattern=r"^(replicas|xor:[0-9]{1,3}|rs:[0-9]{1,3}:[0-9]{1,2})$")]
Files = Annotated[dict[Annotated[str, msgspec.Meta(max_length=4_096)], FileEntry], msgspec.Meta(max_length=MAX_FILES)]

M = TypeVar("M")

ContentDigest = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


# The CRC32C of any file that ends with its own CRC32C (little-endian), as OCDBT files do: equal CRC32Cs of two such
# files say nothing of their bytes (``step_manifest.file_identity``).
CRC32C_RESIDUE = "48674bc7"


def files_digest(files: Mapping[str, tuple[int, str]]) -> int:
    """A 63-bit digest of a step's checksums (relative path -> (size bytes, CRC32C hex)): equal for copies of the
    same bytes, so a replica of a rank's current step is told from a replica of the bytes it held before
    (``HeldStep.content``). BLAKE2b over the sorted paths, sizes and CRCs; not a security boundary (the copy's
    files are checked against the owner's checksums whenever it is read)."""
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(files):
        size, crc = files[path]
        digest.update(f"{path}\0{size}\0{crc}\n".encode())
    return int.from_bytes(digest.digest(), "big") >> 1


def in_lineage(forks: tuple[int, ...], step: int, timeline: int) -> bool:
    """Whether a copy of ``step`` written in ``timeline`` belongs to the job's history.

    ``forks[t]`` is the step the job was rolled back to when timeline ``t + 1`` began; the current
    timeline is ``len(forks)``. A copy from an earlier timeline belongs only if no later rollback went
    below its step: the steps after a rollback point were abandoned, and the new timeline writes the
    same step numbers again with other values. A timeline newer than ``forks`` knows does not belong
    (yet): the caller has not learnt of that rollback.
    """
    current = len(forks)
    return timeline == current or (timeline < current and step <= min(forks[timeline:]))


def abandoned(forks: tuple[int, ...], step: int, timeline: int) -> bool:
    """Whether a copy is proven abandoned by a rollback (``in_lineage`` is False and its timeline is
    one ``forks`` knows): safe to delete. A copy of a newer timeline is never abandoned."""
    return timeline < len(forks) and not in_lineage(forks, step, timeline)


def extends(longer: tuple[int, ...], shorter: tuple[int, ...]) -> bool:
    """Whether ``longer`` is ``shorter`` followed by more rollbacks (lineages only ever grow)."""
    return len(longer) > len(shorter) and longer[: len(shorter)] == shorter


# Messages are frozen and hold only scalars, strings, tuples, dicts of those and other messages: they
# can take no part in a reference cycle, so the garbage collector need not track them (``gc=False``).
# The coordinator decodes thousands a second and keeps each node's last report; tracked, they made
# up much of what its collector visited.

# Version 2: reports driven by change (checksums sent once, small heartbeats at a pace the coordinator
# sets), data-parallel signatures computed by the agent, one backup lister per job. Release 0.2.0 speaks
# version 2 too: it added only optional headers (``REPORT_ORDER_HEADER``, the peer tier's step bytes).
PROTOCOL_VERSION = 2
# Adjacent versions interoperate, so a rolling upgrade never stops reports (``check_version``): a release
# that changes the wire bumps PROTOCOL_VERSION by one, gives every new field a default (msgspec ignores
# fields it does not know) and still serves and understands the previous version. Version 1 predates the
# rule: version 2 refuses it.
OLDEST_PROTOCOL_VERSION = 2
# A node report's place in its agent's sequence, ``<session hex>:<sequence>`` (``coordinator.report_order``):
# a report delayed past a newer one is refused instead of undoing it.
REPORT_ORDER_HEADER = "X-MTC-Report-Order"
# A node report's proof of its node (``coordinator.node_identity``): the agent's projected ServiceAccount
# token, sent with the cluster token when the coordinator asks for per-node identity.
NODE_TOKEN_HEADER = "X-MTC-Node-Token"


class JobSettings(msgspec.Struct, frozen=True, gc=False):
    """A job's settings from its consumed ``replicator.yaml`` (see ``local_tier.frameworks``)."""

    peer_ranks: Annotated[tuple[Rank, ...], msgspec.Meta(max_length=MAX_RANKS)]
    data_parallelism: Count
    backup_interval_minutes: Annotated[float, msgspec.Meta(gt=0)] | None
    backup_interval_steps: Annotated[int, msgspec.Meta(ge=1)] | None
    redundancy: RedundancyText | None = None


class PodReport(msgspec.Struct, frozen=True, gc=False):
    """A pod published on the reporting node, with what the node knows of its rank.

    Attributes:
      namespace, job, pod_name, pod_uid: identity.
      slice_index, worker_index: from the JobSet pod name or attributes, or None.
      nodes, slices: the job's shape from the volume attributes.
      jax_coordinator_port: the port rank 0's JAX coordinator listens on.
      subdomain: the JobSet DNS subdomain (pods are ``<pod name without suffix>.<subdomain>``).
      published_at: unix seconds of its NodePublishVolume.
      incarnation, rank: the assignment the node holds for it, or None.
      settings: its consumed ``replicator.yaml``, or None.
      ranks_follow_data: False when the job's launcher fixes its rank (torchrun's ``--node-rank``):
        the coordinator then gives each pod the rank of its JobSet index, never the rank whose data
        its node holds (``Framework.ranks_follow_data``).
      nodes_given: whether the volume's attributes set ``nodes``. A coordinator that reads shapes from the API
        server ignores it: a pod waits until the API server places it on the node (``coordinator/kube/kube_overlay.py``).
      address: where the pod is reachable (its IP, else its JobSet DNS name), from the API server. Set
        by the coordinator's overlay, never by a node: it is rank 0's JAX coordinator address.
    """

    namespace: Name
    job: Name
    pod_name: Name
    pod_uid: Text
    slice_index: Rank | None
    worker_index: Rank | None
    nodes: Count
    slices: Count
    jax_coordinator_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    subdomain: Name
    published_at: float
    incarnation: Name | None = None
    rank: Rank | None = None
    settings: JobSettings | None = None
    ranks_follow_data: bool = True
    nodes_given: bool = True
    address: Text | None = None


class HeldStep(msgspec.Struct, frozen=True, gc=False):
    """A committed, checksummed step of one rank's data on the reporting node.

    Attributes:
      files: relative path -> (size bytes, CRC32C hex), from the step's manifest. Sent for the
        node's own data until a coordinator answered a report carrying them (then None: the
        coordinator keeps them), and again whenever a reply sets ``want_files``. Never for replicas.
      replica: True for a copy a peer pushed here, False for the node's own data.
      signature: for the node's own data, the digest of the step's structural metadata
        (``Orbax.logical_signature``): data-parallel peers with equal signatures hold the
        same logical data.
      timeline: the job's timeline the copy was written in (see ``in_lineage``).
      content: for a replica, ``files_digest`` of its checksums: a replica replaced by other bytes of the same
        step (the job wrote the step again) is a new claim; None for the node's own data, and from agents
        before 0.4.
    """

    namespace: Name
    job: Name
    step: Step
    rank: Rank
    files: Files | None = None
    replica: bool = False
    signature: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    timeline: Timeline = 0
    content: ContentDigest | None = None


class BackedUp(msgspec.Struct, frozen=True, gc=False):
    """The steps of a job the backup tier holds complete (``COMMIT`` written), as (step, timeline),
    as the node last listed them at ``listed_at`` (unix seconds): the coordinator believes the newest
    listing of any node."""

    namespace: Name
    job: Name
    steps: Annotated[tuple[tuple[Step, Timeline], ...], msgspec.Meta(max_length=MAX_LIST)]
    listed_at: float = 0.0


class Lineage(msgspec.Struct, frozen=True, gc=False):
    """A job's rollbacks (see ``in_lineage``), sent only once it has one. The coordinator tells every
    node of the job; nodes keep it on the job's ramdisk and report it back, so a restarted
    coordinator learns it again."""

    namespace: Name
    job: Name
    forks: Forks


class JobRef(msgspec.Struct, frozen=True, gc=False):
    """A job, by namespace and name: the one job key of the coordinator and its clients.

    Hashed like a tuple of its two strings (msgspec hashes the fields; a string caches its hash).
    """

    namespace: Name
    job: Name

    @classmethod
    def parse(cls, text: str) -> "JobRef":
        """The job named ``NAMESPACE/JOB`` (the CLI's ``--job``).

        Raises:
          ValueError: ``text`` is not two non-empty names joined by ``/``.
        """
        namespace, sep, job = text.partition("/")
        if not sep or not namespace or not job or "/" in job:
            raise ValueError(f"{text!r} must be NAMESPACE/JOB")
        return cls(namespace, job)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.job}"


class PodRank(msgspec.Struct, frozen=True, gc=False):
    """A pod's place in its job: the incarnation that assigned it and its rank (node rank) there."""

    job: JobRef
    incarnation: str
    rank: int


class NodeReport(msgspec.Struct, frozen=True, gc=False):
    """Everything a node agent tells the coordinator; sent on every change and as its heartbeat.

    Attributes:
      node_id: the node's name.
      url: the agent's HTTP base URL (peer service).
      pod_address: the address pods on the node are reachable at, or None for JobSet DNS.
      topology: topology labels (``--topology``).
      pods: the pods published on the node.
      held: the committed steps the node holds, its own and replicas of other ranks'.
      replicas: how many peers should hold replicas of this node's steps (``--replicas``).
      backed_up: per job, the complete backups the node saw in the backup tier, once listed.
      has_backup: whether the node has a backup tier (``--backup``).
      protocol: the agent's ``PROTOCOL_VERSION``; a report without it is from version 1.
      waiting: True when a pod of the node waits for its assignment: the coordinator may hold the
        reply (long poll) until the assignment exists, for up to ``MAX_WAIT_SECONDS``.
      lineages: the rollbacks of its jobs the node knows of (jobs never rolled back are left out).
      redundancy: how this node's jobs keep RAM copies unless their settings say (``--redundancy``).
      shards: the parity shards the node holds.
      notices: what the node's operator should see as Warning events (``Notice``), sent until acknowledged; an
        older coordinator ignores the field.
    """

    node_id: Name
    url: Text
    pod_address: Text | None
    topology: Annotated[dict[Name, Text], msgspec.Meta(max_length=64)]
    pods: Annotated[tuple[PodReport, ...], msgspec.Meta(max_length=MAX_PODS)]
    held: Annotated[tuple[HeldStep, ...], msgspec.Meta(max_length=MAX_HELD)]
    replicas: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    backed_up: Annotated[tuple[BackedUp, ...], msgspec.Meta(max_length=MAX_PODS)] = ()
    has_backup: bool = False
    protocol: int = 1
    waiting: bool = False
    lineages: Annotated[tuple[Lineage, ...], msgspec.Meta(max_length=MAX_PODS)] = ()
    redundancy: RedundancyText = "replicas"
    shards: Annotated[tuple["HeldShard", ...], msgspec.Meta(max_length=MAX_HELD)] = ()
    notices: Annotated[tuple["Notice", ...], msgspec.Meta(max_length=MAX_NOTICES)] = ()


class Notice(msgspec.Struct, frozen=True, gc=False):
    """Something a node agent saw that its operator should see as a Warning event (the agent holds no API
    credentials: the coordinator sends it, on the pod named if the API server places that pod on the node, else on
    the Node when ``pod_uid`` is None).

    Attributes:
      reason: one of ``NOTICE_REASONS``.
      message: one sentence, at most ``MAX_NOTICE_CHARS`` characters.
      namespace, pod_uid: the pod it is about (its namespace and UID, as the CSI volume context gives them), or
        None for the node itself.
    """

    reason: Annotated[str, msgspec.Meta(max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=MAX_NOTICE_CHARS)]
    namespace: Annotated[str, msgspec.Meta(max_length=63)] | None = None
    pod_uid: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class Versioned(msgspec.Struct):
    """Just the version of a message whose other fields may not decode."""

    protocol: int = 1


class Assignment(msgspec.Struct, frozen=True, gc=False):
    """A pod's place in its job's incarnation.

    Attributes:
      incarnation: id of the set of pods this assignment belongs to.
      rank: the pod's node rank (JAX process id).
      jax_coordinator: ``host:port`` of rank 0's JAX coordinator.
      nodes: the incarnation's node count (``replicator.yaml``'s ``nodes`` must match it), or None from an
        older coordinator.
    """

    pod_uid: Text
    incarnation: Name
    rank: Rank
    jax_coordinator: Text
    nodes: Count | None = None


class Target(msgspec.Struct, frozen=True, gc=False):
    """A node to push a replica to: its id, its peer service's base URL, and the coordinator's grant for the
    push (``replicator.wire.grants``; None where the coordinator issues none)."""

    node: Name
    url: Text
    grant: Text | None = None


class ReplicateOrder(msgspec.Struct, frozen=True, gc=False):
    """Push ``rank``'s ``step`` from the receiving node to ``targets``."""

    namespace: Name
    job: Name
    rank: Rank
    step: Step
    targets: Annotated[tuple[Target, ...], msgspec.Meta(max_length=MAX_LIST)]


class RetainOrder(msgspec.Struct, frozen=True, gc=False):
    """Garbage collection: delete the job's steps and replicas older than ``keep_from``, except ``protected``.
    Under pressure a node may also give up steps newer than ``keep_from`` that are not ``protected``
    (``replicator.local_tier.space``)."""

    namespace: Name
    job: Name
    keep_from: Step
    protected: Annotated[tuple[Step, ...], msgspec.Meta(max_length=MAX_LIST)]


class BackupOrder(msgspec.Struct, frozen=True, gc=False):
    """Upload ``rank``'s own data of ``step`` to the backup tier.

    Attributes:
      incarnation: tags the upload: one tag per choice of a backup (the id of the incarnation that chose it and a
        random suffix), kept by later incarnations until one restores an older step; ``COMMIT`` joins only ranks of
        one tag.
      nodes: the job's rank count, for ``COMMIT``.
      dedup_from_rank: a data-parallel peer whose upload of the step to reference for identical
        files (wait for it), or None to upload everything.
      protected: backup steps retention must keep (a restore is using them).
      timeline: the job's current timeline: the backup is stored as that timeline's (write-once,
        never mixed with an abandoned timeline's objects of the same step).
      forks: the job's rollbacks: retention deletes backups of abandoned timelines.
      share_group: the ranks (sorted, this one among them) found identical at the step, which share
        its upload (``backup_tier.shared_upload``: each uploads its share, then references the
        others'); empty when ``dedup_from_rank`` applies.
      data_rank: set when ``rank``'s node was lost mid-backup and this node stands in for it with its own data of
        the step, rank ``data_rank``'s, a data-parallel peer whose checksums of the step are ``rank``'s
        (``coordinator.copies.backups.stand_ins``): once ``data_rank``'s upload of this backup is stored, the node
        stores ``rank``'s manifest naming its objects, uploading nothing. None: upload ``rank``'s own data or replica.
      data_digest: with ``data_rank``, ``files_digest`` of ``rank``'s checksums of the step, as its own node reported
        them: the node references only a copy of ``data_rank`` with exactly these checksums.
    """

    namespace: Name
    job: Name
    step: Step
    rank: Rank
    incarnation: Name
    nodes: Count
    dedup_from_rank: Rank | None
    protected: Annotated[tuple[Step, ...], msgspec.Meta(max_length=MAX_LIST)]
    timeline: Timeline = 0
    forks: Forks = ()
    share_group: Annotated[tuple[Rank, ...], msgspec.Meta(max_length=MAX_RANKS)] = ()
    data_rank: Rank | None = None
    data_digest: Annotated[int, msgspec.Meta(ge=0)] | None = None


class ReportReply(msgspec.Struct, frozen=True, gc=False):
    """The coordinator's answer to a ``NodeReport``: what the node's pods and data should do.

    Attributes:
      assignments, replicate, retain, backup: the node's pods' ranks and its standing orders,
        repeated in every reply while they stand.
      heartbeat_seconds: report at least this often (jittered) even when nothing changed; the
        coordinator lengthens it as the cluster grows, to keep its load bounded.
      want_files: send the checksums of every held step of the node's own data in the next report
        (the coordinator restarted or forgot them).
      list_backups: the jobs whose backup tier this node lists (one lister per job).
      lineages: the rollbacks of the node's jobs (jobs never rolled back are left out): the node
        tags new steps with the current timeline and deletes copies of abandoned ones.
      grant_key: the public key the coordinator signs peer grants with (``replicator.wire.grants``), or
        None where it issues none.
      encode: the parity shards the node builds (jobs with ``xor`` or ``rs`` redundancy).
      protocol: the coordinator's ``PROTOCOL_VERSION``.
    """

    assignments: tuple[Assignment, ...]
    replicate: tuple[ReplicateOrder, ...] = ()
    retain: tuple[RetainOrder, ...] = ()
    backup: tuple[BackupOrder, ...] = ()
    heartbeat_seconds: float = 1.0
    want_files: bool = False
    list_backups: tuple[JobRef, ...] = ()
    lineages: tuple[Lineage, ...] = ()
    grant_key: Text | None = None
    encode: tuple["EncodeOrder", ...] = ()
    protocol: int = PROTOCOL_VERSION


class Tier(enum.StrEnum):
    """Where a restore source is, fastest first (``TIER_PREFERENCE``). The values are the wire's
    ``Source.tier`` (msgspec encodes a member by its value), the ``source`` label of the agent's
    ``mtc_restore_seconds`` and the ``tier`` of ``tier:holder`` in the coordinator's status."""

    LOCAL = "local"  # the rank's own node
    PEER_CLOSE = "peer_close"  # another node in the same topology block
    PEER_DISTANT = "peer_distant"  # another node elsewhere
    DECODE = "decode"  # rebuilt from the rank's parity group: its survivors' steps and parity shards
    BACKUP = "backup"  # object storage


# Tier -> its place in the order of preference (0: fastest). Sort by it: the values sort by name.
TIER_PREFERENCE: dict[Tier, int] = {tier: place for place, tier in enumerate(Tier)}


class Source(msgspec.Struct, frozen=True, gc=False):
    """One place a rank can restore its step from.

    Attributes:
      tier: which tier serves the copy.
      holder: the node holding the copy, or ``backup``.
      url: the holder's peer service base URL, or None.
      data_rank: whose data the copy is (a data-parallel peer's for identical data).
      files: the checksums the data rank's own node reported for the step (relative path ->
        (size, CRC32C)): what a fetched copy must match, whoever serves it. None when the
        coordinator does not know them (a backup: the store's manifest is checked instead).
      timeline: the timeline the copy was written in (a backup's is part of its name).
      grant: the coordinator's grant to fetch the copy from ``holder`` (``replicator.wire.grants``), or None.
      recipe: for ``Tier.DECODE``: the group's members and parity shards to rebuild the copy from.
    """

    tier: Tier
    holder: Name
    url: Text | None
    data_rank: Rank
    files: Files | None = None
    timeline: Timeline = 0
    grant: Text | None = None
    recipe: "ParityRecipe | None" = None


class MemberCopy(msgspec.Struct, frozen=True, gc=False):
    """Where a parity group member's step is read from (``EncodeOrder``, ``ParityRecipe``).

    Attributes:
      rank: the member rank.
      node: a live node holding its step, or None when none does (the member is lost).
      url: that node's peer service base URL, or None.
      grant: the coordinator's grant to fetch the step there (``replicator.wire.grants``), or None.
      digest: in an encode order, the member's checksums' ``redundancy.files_digest``: what it must read.
    """

    rank: Rank
    node: Name | None = None
    url: Text | None = None
    grant: Text | None = None
    digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | None = None


class ShardCopy(msgspec.Struct, frozen=True, gc=False):
    """A parity shard a decode reads: stripe ``stripe``'s shard ``index``, held by ``node``, CRC-32C ``crc32c``."""

    stripe: Rank
    index: Rank
    node: Name
    url: Text
    crc32c: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{8}$")] | None = None
    grant: Text | None = None


class ParityRecipe(msgspec.Struct, frozen=True, gc=False):
    """What rebuilding one member's step reads (``replicator.parity.layout`` gives the layout).

    Attributes:
      members: the group's members, in position order; a lost one has no ``node``.
      parity: parity shards per stripe.
      stream_bytes: each member's stream length, bytes, position order.
      shards: the live parity shards.
    """

    members: Annotated[tuple[MemberCopy, ...], msgspec.Meta(max_length=MAX_LIST)]
    parity: Count
    stream_bytes: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_LIST)]
    shards: Annotated[tuple[ShardCopy, ...], msgspec.Meta(max_length=MAX_LIST)]


class EncodeOrder(msgspec.Struct, frozen=True, gc=False):
    """Build this node's parity shards of a group's step: those of the stripes its position holds.

    Attributes:
      namespace, job, step: the step.
      position: this node's position among ``members``.
      members: the group's members in position order, each read from its own node.
      parity: parity shards per stripe (1: XOR).
      stream_bytes: each member's stream length, bytes (from its owner's checksums), position order.
    """

    namespace: Name
    job: Name
    step: Step
    position: Rank
    members: Annotated[tuple[MemberCopy, ...], msgspec.Meta(max_length=MAX_LIST)]
    parity: Count
    stream_bytes: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_LIST)]


class ParityShard(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A parity shard of a group's step, built by keyword: the one shard type. A node's report carries it with its
    job (``HeldShard``); the node's ramdisk keeps it with the members' stream lengths (``ShardMeta``,
    ``replicator.local_tier.parity_shards``). Its layout is ``replicator.parity.layout.GroupLayout``'s.

    Attributes:
      step: the step it protects.
      members: the group's member ranks, position order.
      parity: parity shards per stripe.
      stripe, index: which shard.
      bytes: its size.
      crc32c: its CRC-32C, 8 hex digits.
      basis: the members' checksums it was built over (``redundancy.basis``).
    """

    step: Step
    members: Annotated[tuple[Rank, ...], msgspec.Meta(max_length=MAX_LIST)]
    parity: Count
    stripe: Rank
    index: Rank
    bytes: Annotated[int, msgspec.Meta(ge=0)]
    crc32c: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{8}$")]
    basis: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class HeldShard(ParityShard, frozen=True, gc=False, kw_only=True):
    """A parity shard a node holds and verified when it built it, as its report says (``NodeReport.shards``).

    Attributes:
      namespace, job: the job whose step it protects.
    """

    namespace: Name
    job: Name


class RestoreView(msgspec.Struct, frozen=True, gc=False):
    """What one rank must restore, as the coordinator sees it now.

    Attributes:
      generation: id of the current plan; a new one after a source failed everywhere.
      step: the step every rank restores, or None to start fresh.
      sources: this rank's sources, in order of preference.
      ready: True once every rank has staged and verified the step: write the marker.
      rollback: the step is an operator's rollback (``mtc restore-from``): newer steps are
        abandoned and deleted, not set aside.
      forks: the job's rollbacks, this one included: the timeline the job trains in after the restore.
      fan_out_pending: the step is held only in the backup tier and an identical rank's node is
        downloading it for this rank (read-once restore): wait for a view that lists that node,
        up to the agent's fan-out wait, before reading ``sources`` (the store) itself.
      saved_nodes: None for a restore at the step's own node count. Otherwise an elastic restore: the job
        saved the step on ``saved_nodes`` nodes and runs on another count; ``sources`` then list, for each
        old node whose copy this rank needs (their ``data_rank``), its sources in order of preference, and
        the rank stages one verified copy of each (``prefetch.resharded``).
    """

    generation: Text
    step: Step | None
    sources: tuple[Source, ...]
    ready: bool
    rollback: bool = False
    forks: Forks = ()
    fan_out_pending: bool = False
    saved_nodes: Count | None = None

    @property
    def token(self) -> str:
        """What a rank knows of this view, to long-poll for a different one (``seen``)."""
        return f"{self.generation}:{int(self.ready)}{':w' if self.fan_out_pending else ''}"


# Typed routes of the coordinator besides reports (``replicator.coordinator.api.routes``). The JSON field
# names are the routes' wire format: ``mtc`` clients of older releases send and read the same.

BadCopy = tuple[Step, Rank, Name]  # (step, rank, holder): a copy a rank found corrupt or gone


class SettingsRequest(msgspec.Struct, frozen=True, gc=False):
    """``POST /v1/jobs/{ns}/{job}/settings``: the settings a rank's ``replicator.yaml`` carried."""

    incarnation: Name
    rank: Rank
    settings: JobSettings


class StagedReport(msgspec.Struct, frozen=True, gc=False):
    """``POST /v1/jobs/{ns}/{job}/restore``: a rank's staging result.

    Attributes:
      incarnation, generation, rank: the view it staged (``RestoreView.generation``).
      source: ``tier:holder`` it staged the step from, or None when no source served.
      bad: copies proven unusable (a checksum mismatch, or the holder no longer has it).
      retrying: the rank will try unreachable sources again (no replan).
    """

    incarnation: Name
    generation: Text
    rank: Rank
    source: Text | None = None
    bad: Annotated[tuple[BadCopy, ...], msgspec.Meta(max_length=MAX_LIST)] = ()
    retrying: bool = False


# The longest a coordinator holds a long-poll request (a waiting report, a restore view), seconds.
# Agents time such requests out 10 s later; short enough that a lost reply costs little.
MAX_WAIT_SECONDS = 20.0


class ProtocolMismatch(ValueError):
    """The other side speaks a ``PROTOCOL_VERSION`` this one does not interoperate with."""


def compatible_versions(ours: int = PROTOCOL_VERSION, oldest: int = OLDEST_PROTOCOL_VERSION) -> range:
    """The protocol versions a side speaking ``ours`` works with: its own and the adjacent ones (an
    agent or coordinator one release behind or ahead: both directions of a rolling upgrade), but none
    below ``oldest``."""
    return range(max(ours - 1, oldest), ours + 2)


def check_version(theirs: int, who: str) -> None:
    """Raises ``ProtocolMismatch`` naming both versions unless ``theirs`` is in ``compatible_versions()``."""
    accepted = compatible_versions()
    if theirs not in accepted:
        raise ProtocolMismatch(
            f"{who} speaks mtc protocol version {theirs}; this side speaks version {PROTOCOL_VERSION} and works with "
            f"versions {accepted.start}-{accepted.stop - 1} (adjacent releases): upgrade one release at a time, "
            "the coordinator first (docs/upgrading.md)"
        )


def decode_json(body: bytes, kind: type[M]) -> M:
    """Decodes and validates a JSON body as ``kind`` in one pass (msgspec).

    Raises:
      ValueError: not JSON, or a field is missing, of the wrong type, or out of bounds.
    """
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as err:
        raise ValueError(str(err)) from None


def decode(raw: Any, kind: type[M]) -> M:
    """Validates already-parsed JSON (``dict``/``list``) as message type ``kind``.

    Raises:
      ValueError: a field is missing, of the wrong type, or out of bounds; the message names it.
    """
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as err:
        raise ValueError(str(err)) from None


def to_json(message: Any) -> Any:
    """A message (or list of them) as plain JSON-ready values."""
    return msgspec.to_builtins(message)
