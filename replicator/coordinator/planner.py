"""Pure decisions of the coordinator: rank assignment and restore planning.

No I/O: inputs are what node agents reported, outputs are plans, so this can be tested with
thousands of fake nodes.
"""

import dataclasses
import enum
from collections.abc import Collection, Iterable, Mapping

from replicator.wire.messages import TIER_PREFERENCE, Tier


@dataclasses.dataclass(frozen=True)
class PodSlot:
    """A live, published pod of a job.

    Attributes:
      pod_uid: the pod's UID.
      node_id: the node it runs on.
      slice_index: JobSet job index, or None.
      worker_index: JobSet pod index within the slice, or None.
      published_at: unix seconds of its NodePublishVolume.
    """

    pod_uid: str
    node_id: str
    slice_index: int | None
    worker_index: int | None
    published_at: float


class CopyKind(enum.Enum):
    """Where a ``StepCopy`` is."""

    HELD = "held"  # on its holder node's ramdisk
    BACKUP = "backup"  # in the backup tier (object storage): holder ``BACKUP_HOLDER``
    DECODE = "decode"  # rebuilt from its parity group (``coordinator.planning.parity``): holder ``DECODE_HOLDER``


BACKUP_HOLDER = "backup"  # the holder of a backed-up copy: no node holds it (a source's holder on the wire)
DECODE_HOLDER = "parity"  # the holder of a decodable copy: no one node holds it


@dataclasses.dataclass(frozen=True)
class StepCopy:
    """A committed, checksummed copy of one rank's data for one step, held somewhere.

    Attributes:
      step: the training step.
      rank: the node rank whose data it is.
      holder: node id holding it (``BACKUP_HOLDER``, ``DECODE_HOLDER`` for the other kinds).
      kind: where it is (``CopyKind``).
    """

    step: int
    rank: int
    holder: str
    kind: CopyKind = CopyKind.HELD

    @classmethod
    def backed_up(cls, step: int, rank: int) -> "StepCopy":
        """A complete backup of ``rank``'s data at ``step``."""
        return cls(step, rank, BACKUP_HOLDER, CopyKind.BACKUP)

    @classmethod
    def decodable(cls, step: int, rank: int) -> "StepCopy":
        """``rank``'s data at ``step``, which its parity group's survivors and shards can rebuild."""
        return cls(step, rank, DECODE_HOLDER, CopyKind.DECODE)


@dataclasses.dataclass(frozen=True)
class PlannedSource:
    """Where the plan has a rank restore its step from; the rank's view carries it on the wire as a
    ``messages.Source``, with the holder's URL and the checksums a copy must match."""

    tier: Tier
    holder: str
    data_rank: int


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores and, per rank, its sources in preference order.

    ``step`` is None when no step is restorable: every rank starts fresh (Orbax's ``s0`` marker).
    ``fan_out`` maps a rank whose only copies are in the backup tier to the node of its identical
    group's downloader (a peer source, ``data_rank`` the downloader's rank): once that rank has
    staged the step, the others fetch it from there instead of reading the store again.
    """

    step: int | None
    sources: Mapping[int, tuple[PlannedSource, ...]]
    fan_out: Mapping[int, PlannedSource] = dataclasses.field(default_factory=dict)
    saved_nodes: int | None = None


def select_pods(pods: Iterable[PodSlot], nodes: int) -> list[PodSlot] | None:
    """The pods that form the incarnation: the newest ``nodes`` pods, or None while fewer are live.

    Older pods drop out: they belong to a previous incarnation whose unpublish has not arrived yet.
    """
    newest = sorted(pods, key=lambda p: (-p.published_at, p.pod_uid))[:nodes]
    return newest if len(newest) == nodes else None


def assign_ranks(
    pods: list[PodSlot],
    nodes: int,
    slices: int,
    newest_held: Mapping[str, Mapping[int, int]],
) -> dict[str, int]:
    """Gives each pod of a complete incarnation a distinct rank in ``range(nodes)``.

    Order of preference: the rank whose newest data the pod's node holds (newest step first);
    then the initial rank ``slice * nodes_per_slice + worker``; then any free rank.

    Args:
      pods: exactly ``nodes`` pods (see ``select_pods``).
      nodes: the job's node count.
      slices: the job's slice count; ``nodes`` is a multiple of it.
      newest_held: node id -> {rank: newest committed step of that rank's data on the node}.

    Returns:
      pod uid -> rank.

    Raises:
      ValueError: ``len(pods) != nodes``.
    """
    if len(pods) != nodes:
        raise ValueError(f"an incarnation needs {nodes} pods, got {len(pods)}")
    ranks: dict[str, int] = {}
    taken: set[int] = set()

    def give(pod_uid: str, rank: int) -> None:
        if pod_uid not in ranks and rank not in taken and 0 <= rank < nodes:
            ranks[pod_uid] = rank
            taken.add(rank)

    local_data = sorted(
        ((step, rank, pod.pod_uid) for pod in pods for rank, step in newest_held.get(pod.node_id, {}).items()),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    for _, rank, pod_uid in local_data:
        give(pod_uid, rank)
    per_slice = nodes // slices
    for pod in pods:
        if pod.slice_index is not None and pod.worker_index is not None and pod.worker_index < per_slice:
            give(pod.pod_uid, pod.slice_index * per_slice + pod.worker_index)
    free = iter(sorted(set(range(nodes)) - taken))
    for pod in sorted(pods, key=lambda p: (p.slice_index or 0, p.worker_index or 0, p.pod_uid)):
        if pod.pod_uid not in ranks:
            give(pod.pod_uid, next(free))
    return ranks


def plan_restore(
    nodes: int,
    node_of_rank: Mapping[int, str],
    copies: Iterable[StepCopy],
    block_of: Mapping[str, str] | None = None,
    usable_tiers: frozenset[Tier] = frozenset(Tier),
    identical: Mapping[int, frozenset[tuple[int, int]]] | None = None,
    fan_out: bool = True,
    silent: Collection[str] = frozenset(),
    shapes: Mapping[int, int] | None = None,
) -> RestorePlan:
    """Picks the newest step that every rank can restore, and each rank's sources.

    A step qualifies only if each rank ``0..nodes-1`` has at least one copy reachable through
    ``usable_tiers`` from the node it is assigned to; otherwise an older step is tried. A copy of
    a data-parallel peer's data serves a rank when the two were found identical at that step.

    Args:
      nodes: the job's node count.
      node_of_rank: rank -> node id of this incarnation.
      copies: every verified copy the cluster reported.
      block_of: node id -> topology block, to tell close peers from distant ones.
      usable_tiers: tiers the restore may use.
      identical: step -> pairs of ranks (both orders) holding the same logical data at that step.
      fan_out: read each unique shard from the backup tier once per identical group (see
        ``RestorePlan.fan_out``); False: every rank reads its own.
      silent: nodes silent past the node timeout. Their copies stay sources, but do not keep a group
        from fanning out: after a cluster loss every lost node is silent, not yet forgotten, for the
        grace period.
      shapes: step -> the node count it was saved at, for the steps saved at another count than
        ``nodes`` that the job can reshard (``coordinator.elastic.saved_shapes``): such a step
        qualifies when every old node each rank needs has a copy reachable from the rank's node.

    Returns:
      The plan; ``step`` is None when nothing qualifies.
    """
    block_of = block_of or {}
    identical = identical or {}
    shapes = shapes or {}
    by_step = _by_step_and_rank(copies)
    for step in sorted(by_step, reverse=True):
        held = by_step[step]
        peers = _identical_peers(identical.get(step, ()))
        if (saved := shapes.get(step)) is not None:
            elastic = _elastic_sources(held, saved, nodes, node_of_rank, block_of, usable_tiers)
            if elastic is not None:
                return RestorePlan(step, elastic, saved_nodes=saved)
            continue
        sources = _step_sources(held, peers, nodes, node_of_rank, block_of, usable_tiers)
        if all(sources.values()):
            fanned = _fan_out(sources, peers, node_of_rank, block_of, usable_tiers, silent) if fan_out else {}
            return RestorePlan(step, sources, fanned)
    return RestorePlan(None, {rank: () for rank in range(nodes)})


def _by_step_and_rank(copies: Iterable[StepCopy]) -> dict[int, dict[int, list[StepCopy]]]:
    """Step -> data rank -> its copies, in the order given."""
    by_step: dict[int, dict[int, list[StepCopy]]] = {}
    for copy in copies:
        by_step.setdefault(copy.step, {}).setdefault(copy.rank, []).append(copy)
    return by_step


def _identical_peers(pairs: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """Rank -> the ranks found identical to it at a step, from the step's pairs (both orders)."""
    peers: dict[int, list[int]] = {}  # one pass over the pairs: a 10,000-rank job has 400,000 of them
    for first, other in pairs:
        peers.setdefault(first, []).append(other)
    return peers


def _step_sources(
    held: Mapping[int, list[StepCopy]],
    peers: Mapping[int, list[int]],
    nodes: int,
    node_of_rank: Mapping[int, str],
    block_of: Mapping[str, str],
    usable: frozenset[Tier],
) -> dict[int, tuple[PlannedSource, ...]]:
    """Per rank, the reachable copies of a step held as ``held`` (data rank -> copies) that serve it: its own
    data's and its identical peers', fastest first (``_ranked_sources``); empty for a rank none serves."""
    sources: dict[int, tuple[PlannedSource, ...]] = {}
    made: dict[tuple[Tier, str, int], PlannedSource] = {}  # shared by the ranks listing a source
    for rank in range(nodes):
        candidates = [copy for data_rank in (rank, *peers.get(rank, ())) for copy in held.get(data_rank, ())]
        sources[rank] = _ranked_sources(candidates, node_of_rank[rank], block_of, usable, rank, made)
    return sources


def old_nodes_needed(new_rank: int, new_nodes: int, old_nodes: int) -> range:
    """The old nodes whose copies a node of a resharded job stages: those whose share of the flat
    global-rank order overlaps its own, widened by one old node on each side.

    FSDP/HSDP shard dim 0 with ``torch.chunk``: with ``D`` rows over ``R`` ranks, rank ``i`` holds
    ``[i * ceil(D / R), (i + 1) * ceil(D / R))``. Where ``R`` divides ``D`` at both world sizes that is the
    even split, and the overlap alone is exact. Otherwise rows sit earlier than an even split puts them,
    by less than ``R`` rows; the margin covers that when every sharded dim 0 holds at least
    max(new world size x old nodes, old world size x (old nodes - 1)) rows. The coordinator never sees
    the tensors: past that, or for a sharding across nodes other than dim 0 (tensor parallelism over
    nodes), the job's reader refuses the load (``mtc_torch.PartialRestoreError``), never a partial one.
    A job saved on 2 nodes stages both on every new node.

    Args:
      new_rank: the node rank in the new shape; new_nodes, old_nodes: the node counts.

    Returns:
      The old node ranks, ascending.
    """
    low = new_rank * old_nodes // new_nodes
    high = -(-(new_rank + 1) * old_nodes // new_nodes)  # ceil: exclusive end of the overlap
    return range(max(0, low - 1), min(old_nodes, high + 1))


def _elastic_sources(
    held: Mapping[int, list[StepCopy]],
    saved: int,
    nodes: int,
    node_of_rank: Mapping[int, str],
    block_of: Mapping[str, str],
    usable: frozenset[Tier],
) -> dict[int, tuple[PlannedSource, ...]] | None:
    """Per rank of the ``nodes``-node job, the sources of every old node's copy it needs
    (``old_nodes_needed``) of a step saved on ``saved`` nodes, old node by old node; None when one
    has no reachable copy. Only the old node's own data serves it: a data-parallel peer's identical
    copy would be staged under the peer's name, and the rank stages one copy per old node named."""
    sources = {}
    for rank in range(nodes):
        parts: list[PlannedSource] = []
        for old in old_nodes_needed(rank, nodes, saved):
            ranked = _ranked_sources(held.get(old, []), node_of_rank[rank], block_of, usable)
            if not ranked:
                return None
            parts += ranked
        sources[rank] = tuple(parts)
    return sources


def _fan_out(
    sources: Mapping[int, tuple[PlannedSource, ...]],
    peers: Mapping[int, list[int]],
    node_of_rank: Mapping[int, str],
    block_of: Mapping[str, str],
    usable: frozenset[Tier],
    silent: Collection[str],
) -> dict[int, PlannedSource]:
    """Rank -> its downloader's peer source, for the ranks of identical groups held only in the
    backup tier or on ``silent`` nodes: the group's lowest rank downloads (its first source is its own
    backup), the others wait for its node. A group with any copy on a live node restores from it as before."""
    fanned = {}
    for rank, ranked in sources.items():
        if not peers.get(rank) or any(s.tier != Tier.BACKUP and s.holder not in silent for s in ranked):
            continue
        downloader = min(rank, *peers[rank])
        if downloader == rank:
            continue
        holder, target = node_of_rank[downloader], node_of_rank[rank]
        tier = _tier(StepCopy(0, downloader, holder), target, block_of)
        if tier in usable and tier != Tier.LOCAL:
            fanned[rank] = PlannedSource(tier, holder, downloader)
    return fanned


def _tier(copy: StepCopy, target: str, block_of: Mapping[str, str], target_block: str | None = None) -> Tier:
    """The tier of ``copy`` as a source of the node ``target`` (``target_block``: its block, when the caller has it)."""
    if copy.kind is CopyKind.BACKUP:
        return Tier.BACKUP
    if copy.kind is CopyKind.DECODE:
        return Tier.DECODE
    if copy.holder == target:
        return Tier.LOCAL
    holder_block = block_of.get(copy.holder)
    if holder_block is not None and holder_block == (block_of.get(target) if target_block is None else target_block):
        return Tier.PEER_CLOSE
    return Tier.PEER_DISTANT


def _ranked_sources(
    copies: list[StepCopy],
    target: str,
    block_of: Mapping[str, str],
    usable: frozenset[Tier],
    rank: int | None = None,
    made: dict[tuple[Tier, str, int], PlannedSource] | None = None,
) -> tuple[PlannedSource, ...]:
    """``copies`` as sources of the node ``target``, by expected time: a peer's copy is one stream; a decode reads
    as many bytes from N - K nodes and rebuilds them at a few GB/s per core; the backup tier is an object store.
    Within a tier, ``rank``'s own data comes before an identical peer's: a peer's files may be other bytes of
    the same arrays (Orbax's ``ocdbt.process_<i>/``), and a node holding a step in other bytes than its rank
    wrote drops that step's pending backup (``copies.backups``), while the rank's own bytes keep it.

    ``made`` shares the sources among the ranks of one plan (they are immutable): the ranks of an identical group
    list the same copies, 10,000 ranks of 40 slices about 800,000 of them."""
    target_block = block_of.get(target)
    ranked = set()  # sorted as (preference, not the rank's own data, holder, data rank): the tier follows preference
    for c in copies:
        tier = _tier(c, target, block_of, target_block)
        if tier in usable:
            ranked.add((TIER_PREFERENCE[tier], c.rank != rank, c.holder, c.rank, tier))
    made = {} if made is None else made
    sources = []
    for _, _, holder, data_rank, tier in sorted(ranked):
        if (source := made.get((tier, holder, data_rank))) is None:
            source = made[(tier, holder, data_rank)] = PlannedSource(tier, holder, data_rank)
        sources.append(source)
    return tuple(sources)


def replica_targets(
    node_of_rank: Mapping[int, str], block_of: Mapping[str, str], replicas: int
) -> dict[int, list[str]]:
    """Chooses, per rank, the nodes that hold replicas of its steps (data parallelism 1).

    The first replica is "close" (the next node of the same topology block), the second "distant"
    (the node at the same position in the next block). Both are rings, so every node hosts at most
    ``replicas`` replicas, and the choice depends only on the incarnation's placement: it is
    stable across steps. Never the rank's own node.

    Args:
      node_of_rank: rank -> node id.
      block_of: node id -> topology block (missing: one shared block).
      replicas: 1 or 2.

    Returns:
      rank -> target node ids, close first; shorter when the cluster has too few nodes.
    """
    blocks: dict[str, list[str]] = {}
    for node in sorted(set(node_of_rank.values())):
        blocks.setdefault(block_of.get(node, ""), []).append(node)
    order = sorted(blocks)
    next_block = {block: blocks[order[(i + 1) % len(order)]] for i, block in enumerate(order)}
    position_of = {node: i for members in blocks.values() for i, node in enumerate(members)}
    targets: dict[int, list[str]] = {}
    for rank, node in node_of_rank.items():
        block = block_of.get(node, "")
        members, position = blocks[block], position_of[node]
        chosen = []
        if len(members) > 1:
            chosen.append(members[(position + 1) % len(members)])
        if replicas > 1 and len(order) > 1:
            other = next_block[block]
            chosen.append(other[position % len(other)])
        elif replicas > 1 and len(members) > 2:
            chosen.append(members[(position + 2) % len(members)])
        if not chosen and len(order) > 1:  # a block of one: its close peer must be elsewhere
            other = next_block[block]
            chosen.append(other[position % len(other)])
        targets[rank] = chosen[:replicas]
    return targets
