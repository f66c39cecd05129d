"""Erasure-coded redundancy (``xor:N``, ``rs:N:K``; ``replicator.wire.redundancy``): the groups, the encode
orders, when a step is safe, and which lost ranks a restore can decode (``replicator.parity`` does the bytes).

- Groups: the incarnation's encoded ranks (those without a data-parallel peer: ``encoded_ranks``) are dealt
  into groups of at most N; ranks sorted by topology block go to groups in turn, so two members share a block
  only when a block has more nodes than there are groups. Chosen once per incarnation and setting: stable
  across steps, like the replica rings.
- Encoding: the replication round's step (``replicas.choose_round``) once every member's own node holds it;
  each member's node builds the shards of the stripes its position holds (``GroupLayout.held_by``). The
  decision pass places the orders (``place_orders``, into ``parity_orders.ParityOrders``) and replies hand them
  out (``orders``).
- Belief: a shard counts only from the node ordered to build that (step, group, stripe, index) over that basis;
  any other claim (another stripe's or member's shard, a step or basis never ordered) is ignored, so no one
  member can fill the slots ``safe`` counts. A restarted coordinator believes no shard until it orders its
  round's step again: shards already built for that order count then, older steps' never.
- Safety: a step is safe when every rank's own node holds it and, for each group, every shard of it is held
  by a live node: any K members lost then leave each stripe enough to rebuild.
- Decoding: a rank's step is decodable when, for each stripe it contributes to, the live members' copies and
  the live shards number at least N - K. The shards' own reports say what group they were built for, so a
  step encoded by an earlier incarnation's groups decodes as it was built.
"""

from collections.abc import Mapping

from replicator.coordinator import planner
from replicator.coordinator.indices.job import JobState
from replicator.coordinator.indices.liveness import Liveness, NodeState
from replicator.coordinator.indices.parity_orders import ShardSlot
from replicator.wire import redundancy
from replicator.wire.messages import EncodeOrder, Files, HeldShard, JobRef, MemberCopy, ParityRecipe, ShardCopy
from replicator.wire.redundancy import REPLICAS, Redundancy, of_job

_Group = tuple[int, ...]
# (step, members, parity) -> {(stripe, index): (node, shard)}: the shards the live nodes hold (``held_shards``).
HeldShards = dict[tuple[int, _Group, int], dict[tuple[int, int], tuple[str, HeldShard]]]


def job_setting(job: JobState, liveness: Liveness) -> Redundancy:
    """The job's setting: its ``replicator.yaml``'s, else its nodes' common ``--redundancy``."""
    if job.incarnation is None:
        return REPLICAS
    given = [rank for rank, settings in job.settings.items() if settings.redundancy is not None]
    # The nodes' settings are visited again only after a node reported another (8 ms a decision pass at 10,000).
    memo, stamp = job.memo, (job.incarnation.incarnation_id, liveness.redundancy_epoch)
    if memo.redundancy_for != stamp:
        nodes = liveness.nodes
        memo.redundancy_for, memo.redundancy = (
            stamp,
            frozenset(state.report.redundancy for n in job.incarnation.nodes if (state := nodes.get(n)) is not None),
        )
    return of_job(job.settings[min(given)] if given else None, memo.redundancy)


def encoded_ranks(job: JobState) -> list[int]:
    """The ranks parity protects: every rank with settings when the job has no data parallelism, else those
    with no data-parallel peer (Orbax names ``peer-ranks`` even at data parallelism 1: they are not copies then)."""
    single = job.identity.data_parallelism == 1
    return sorted(rank for rank, settings in job.settings.items() if single or not settings.peer_ranks)


def groups(job: JobState, liveness: Liveness, setting: Redundancy) -> list[_Group]:
    """The incarnation's groups under ``setting``, chosen once per (incarnation, setting, encoded ranks) and kept in
    ``job.memo``: the decision pass and the sync step call it; a query reads ``group_of``."""
    incarnation = job.incarnation
    if incarnation is None or not setting.encoded:
        return []
    stamp, ranks = _groups_stamp(job, setting)
    if job.memo.groups_for != stamp:
        job.memo.groups_for, job.memo.groups = stamp, _deal_ranks(job, liveness, setting, ranks)
        job.memo.group_of = {rank: group for group in job.memo.groups for rank in group}
    return job.memo.groups


def group_of(job: JobState, liveness: Liveness, setting: Redundancy) -> Mapping[int, _Group]:
    """Rank -> its group under ``setting`` (as ``groups``), changing nothing: the kept deal when it is current, else
    the deal computed again (a reply between a change and the pass that keeps it)."""
    if job.incarnation is None or not setting.encoded:
        return {}
    stamp, ranks = _groups_stamp(job, setting)
    if job.memo.groups_for == stamp:
        return job.memo.group_of
    return {rank: group for group in _deal_ranks(job, liveness, setting, ranks) for rank in group}


def _groups_stamp(job: JobState, setting: Redundancy) -> tuple[tuple[str, str, tuple[int, ...]], list[int]]:
    incarnation = job.incarnation
    assert incarnation is not None  # the callers check
    ranks = [r for r in encoded_ranks(job) if r in incarnation.node_of_rank]
    return (incarnation.incarnation_id, str(setting), tuple(ranks)), ranks


def _deal_ranks(job: JobState, liveness: Liveness, setting: Redundancy, ranks: list[int]) -> list[_Group]:
    incarnation = job.incarnation
    assert incarnation is not None  # the callers check
    block_of = liveness.blocks(incarnation.node_of_rank[r] for r in ranks)
    return deal(ranks, setting.group, block_of, incarnation.node_of_rank)


def deal(ranks: list[int], size: int, block_of: Mapping[str, str], node_of_rank: Mapping[int, str]) -> list[_Group]:
    """Deals ``ranks`` into ceil(len / size) groups of near-equal size (at least 2 members each), in topology
    block order, one to each group in turn. A single rank forms no group."""
    if len(ranks) < 2:
        return []
    count = -(-len(ranks) // size)
    count = min(count, len(ranks) // 2)  # groups of two with an odd count: one group of three, no lone rank
    ordered = sorted(ranks, key=lambda r: (block_of.get(node_of_rank[r], ""), node_of_rank[r], r))
    dealt: list[list[int]] = [[] for _ in range(count)]
    for i, rank in enumerate(ordered):
        dealt[i % count].append(rank)
    return [tuple(sorted(g)) for g in dealt if len(g) >= 2]


def parity_of(setting: Redundancy, group: _Group) -> int:
    """Shards per stripe for ``group``: the setting's, fewer for a group too small for it."""
    return min(setting.parity, len(group) - 1)


def held_shards(key: JobRef, job: JobState, liveness: Liveness) -> HeldShards:
    """(step, members, parity) -> {(stripe, index): (node, shard)} over the live nodes' reports: only shards the
    node was ordered to build (``ParityOrders.believed``), over the members' current checksums
    (``redundancy.basis``), so an unordered claim, a rewritten step's or an abandoned timeline's old shards never
    count."""
    found: HeldShards = {}
    bases: dict[tuple[int, _Group], str | None] = {}
    # Only nodes ordered to build this job's shards can hold one that counts: the job's orders, not every node of
    # the cluster (a restore of each of 6,250 jobs of 8 nodes scanned all 50,000 nodes: 128 s of CPU).
    for node_id in job.parity_orders.ordered:
        state = liveness.nodes.get(node_id)
        if state is None or not state.report.shards or not liveness.is_live(node_id):
            continue
        for shard in state.report.shards:
            if (shard.namespace, shard.job) != (key.namespace, key.job):
                continue
            if not job.parity_orders.believed(node_id, shard):
                continue  # unordered: else one member could fill every slot ``safe`` counts
            at = (shard.step, shard.members)
            if at not in bases:
                digests = member_digests(job, shard.step, shard.members)
                bases[at] = redundancy.basis(digests) if digests is not None else None
            if shard.basis == bases[at]:
                found.setdefault((shard.step, shard.members, shard.parity), {})[(shard.stripe, shard.index)] = (
                    node_id,
                    shard,
                )
    return found


def _owner_files(job: JobState, step: int, group: _Group) -> list[Files] | None:
    """Each member's owner checksums at ``step``, position order, or None while one is unknown."""
    found = [job.owners.checksums(step, rank) for rank in group]
    return None if any(f is None for f in found) else [f for f in found if f is not None]


def member_digests(job: JobState, step: int, group: _Group) -> tuple[str, ...] | None:
    """Each member's ``redundancy.files_digest`` of its owner's checksums at ``step``, or None while one is unknown."""
    files = _owner_files(job, step, group)
    return None if files is None else tuple(redundancy.files_digest(f) for f in files)


def _own_nodes(job: JobState, liveness: Liveness, step: int, rank: int) -> list[str]:
    """Live nodes holding ``rank``'s own data of ``step`` as the rank's (not replicas)."""
    return sorted(n for n, replica in job.claims.of(step, rank).items() if not replica and liveness.is_live(n))


def stream_bytes(job: JobState, step: int, group: _Group) -> tuple[int, ...] | None:
    """Each member's step length from its owner's checksums, or None while one is unknown."""
    files = _owner_files(job, step, group)
    return None if files is None else tuple(sum(size for size, _ in f.values()) for f in files)


def safe(key: JobRef, job: JobState, liveness: Liveness, setting: Redundancy, step: int, covered: set[int]) -> bool:
    """Whether ``step`` survives any K losses per group: every rank's own node holds it (live), every encoded
    rank's group has all its shards of it on live nodes, and every other rank is ``covered`` (an identical
    data-parallel peer)."""
    assert job.incarnation is not None
    if any(not _own_nodes(job, liveness, step, rank) for rank in job.incarnation.node_of_rank):
        return False
    chosen = groups(job, liveness, setting)
    grouped = {r for g in chosen for r in g}
    if any(r not in grouped and r not in covered for r in job.incarnation.node_of_rank):
        return False
    shards = held_shards(key, job, liveness)
    for group in chosen:
        parity = parity_of(setting, group)
        held = shards.get((step, group, parity), {})
        if len(held) < len(group) * parity:
            return False
    return True


def _slots(step: int, group: _Group, parity: int, position: int) -> list[ShardSlot]:
    """The shards ``position`` of ``group`` holds at ``step``: stripe ``position - j``'s shard ``j`` for each
    ``j < parity`` (``replicator.parity.layout.GroupLayout.held_by``)."""
    return [ShardSlot(step, group, parity, (position - j) % len(group), j) for j in range(parity)]


def place_orders(job: JobState, liveness: Liveness, setting: Redundancy) -> bool:
    """Records the round's encode orders (``job.parity_orders``): the node of each group member builds the shards
    its position holds, over the members' current checksums; a group waits while an owner's are unknown. Placed by
    the decision pass after the round is chosen, so that a reply hands out only orders placed (``orders``).

    Returns:
      whether an order is new: shards already held for it (a restarted coordinator's) count from the next pass.
    """
    step, incarnation = job.decided.round, job.incarnation
    if step is None or incarnation is None or not setting.encoded:
        return False
    chosen = groups(job, liveness, setting)
    # Placed once per groups, step and owners' checksums of it: the digests cost about 70 us a member (60
    # files), 0.7 s a pass at 10,000 ranks.
    placed_for = (job.memo.groups_for, step, job.owners.step_stamps.get(step))
    if job.memo.placed_for == placed_for:
        return False
    job.memo.placed_for = placed_for
    new = False
    for group in chosen:
        digests = member_digests(job, step, group)
        if digests is None:
            continue
        basis, parity = redundancy.basis(digests), parity_of(setting, group)
        for position, rank in enumerate(group):
            new |= job.parity_orders.order(incarnation.node_of_rank[rank], _slots(step, group, parity, position), basis)
    return new


def orders(key: JobRef, job: JobState, state: NodeState, liveness: Liveness) -> list[EncodeOrder]:
    """The node's encodes: the shards its position holds of the round's step, in the group of its rank, once every
    member's own node holds the step and the pass placed the order (``place_orders``), unless its last report lists
    them over the same basis. Costs one group: every reply asks."""
    step, incarnation, setting = job.decided.round, job.incarnation, job.decided.redundancy
    if step is None or incarnation is None or not setting.encoded:
        return []
    node_id = state.report.node_id
    rank = incarnation.rank_of_node.get(node_id)  # one training pod per node and job
    group = group_of(job, liveness, setting).get(rank) if rank is not None else None
    if group is None:
        return []
    position, parity = group.index(rank), parity_of(setting, group)
    sizes, digests = stream_bytes(job, step, group), member_digests(job, step, group)
    if sizes is None or digests is None:
        return []
    basis, slots = redundancy.basis(digests), _slots(step, group, parity, position)
    if any(job.parity_orders.basis_of(node_id, slot) != basis for slot in slots):
        return []  # not placed (yet): a reply between a re-deal or a rewrite and its pass
    held = {
        ShardSlot(s.step, s.members, s.parity, s.stripe, s.index)
        for s in state.report.shards
        if (s.namespace, s.job, s.basis) == (key.namespace, key.job, basis)
    }
    if set(slots) <= held:
        return []
    members = []
    for member, digest in zip(group, digests):
        nodes = _own_nodes(job, liveness, step, member)
        if not nodes:
            return []
        members.append(MemberCopy(member, nodes[0], liveness.url(nodes[0]), digest=digest))
    return [EncodeOrder(key.namespace, key.job, step, position, tuple(members), parity, sizes)]


def decodable(
    key: JobRef, job: JobState, liveness: Liveness, live_copies: list[planner.StepCopy]
) -> list[planner.StepCopy]:
    """A decodable copy (``planner.StepCopy.decodable``) of each member rank its group's live survivors and shards can
    rebuild, at each step with shards; only where the coordinator knows the owners' checksums to verify it."""
    # Live holders only: a silent node's copy stays a restore source for the grace period, but a rebuild cannot
    # count on it (three of an rs:8:2 group lost, their copies still within the grace, looked rebuildable).
    held = {(c.step, c.rank) for c in live_copies if c.kind is planner.CopyKind.HELD and liveness.is_live(c.holder)}
    found = []
    for (step, group, parity), shards in held_shards(key, job, liveness).items():
        # ``held_shards`` keeps only shards whose basis matched every owner's checksums: they are all known here.
        for position, rank in enumerate(group):
            if _rebuildable(
                group,
                parity,
                position,
                {p for p, r in enumerate(group) if (step, r) in held and p != position},
                set(shards),
            ):
                found.append(planner.StepCopy.decodable(step, rank))
    return found


def _rebuildable(group: _Group, parity: int, position: int, live: set[int], shards: set[tuple[int, int]]) -> bool:
    size, data = len(group), len(group) - parity
    for stripe in range(size):
        contributors = [(stripe + parity + i) % size for i in range(data)]
        if position not in contributors:
            continue
        have = sum(p in live for p in contributors) + sum((stripe, j) in shards for j in range(parity))
        if have < data:
            return False
    return True


def recipe(
    key: JobRef, job: JobState, liveness: Liveness, step: int, rank: int, held: HeldShards
) -> ParityRecipe | None:
    """How to rebuild ``rank``'s ``step``: the live members' copies and shards of its group (``held``: ``held_shards``, read
    once per view), or None."""
    for (at, group, parity), shards in held.items():
        sizes = stream_bytes(job, at, group)
        if at != step or rank not in group or sizes is None:
            continue
        digests = member_digests(job, step, group)
        members = []
        for member, digest in zip(group, digests or ("",) * len(group)):
            nodes = _own_nodes(job, liveness, step, member) if member != rank else []
            if not nodes and member != rank:  # a replica or a restored copy serves too
                nodes = sorted(n for n in job.claims.of(step, member) if liveness.is_live(n))
            node = nodes[0] if nodes else None
            url = liveness.url(node) if node else None
            members.append(MemberCopy(member, node, url, digest=digest or None))
        copies = tuple(
            ShardCopy(stripe, index, node, url, shard.crc32c)
            for (stripe, index), (node, shard) in sorted(shards.items())
            if (url := liveness.url(node)) is not None
        )
        return ParityRecipe(tuple(members), parity, sizes, copies)
    return None
