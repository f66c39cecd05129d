"""Erasure-coded redundancy (issue 41) in the coordinator's state, driven by hand-built node reports (no HTTP):
which ranks are grouped and ordered to encode, the parity bytes a group costs, when a step is safe, and the
restore plan of a lost rank (a ``Tier.DECODE`` source with its recipe)."""

from replicator.coordinator import parity
from replicator.coordinator.state import ClusterState, decide_interval
from replicator.parity.layout import GroupLayout, cluster_ram
from replicator.wire import redundancy
from replicator.wire.messages import EncodeOrder, HeldShard, HeldStep, JobRef, JobSettings, Tier
from replicator.wire.redundancy import parse
from tests.helpers.reports import node_report, pod_report

KEY = JobRef("default", "ec")
NAMES = (KEY.namespace, KEY.job)
STEP = 5


def files(rank: int) -> dict[str, tuple[int, str]]:
    """Rank ``rank``'s step: streams of unequal length (the group pads to the longest)."""
    return {f"state/r{rank}": (1000 + 8 * rank, f"{rank + 1:08x}")}


class Job:
    """A job of ``len(settings)`` ranks, one per node ``n<i>`` (own topology block), nodes on ``xor:4``."""

    def __init__(self, state: ClusterState, settings: list[JobSettings], redundancy: str = "xor:4"):
        self.state, self.settings, self.redundancy = state, settings, redundancy
        self.size = len(settings)
        self.slot = {f"n{i}": i for i in range(self.size)}
        self.shards: dict[str, list[HeldShard]] = {}
        self.data: dict[str, int] = {}  # node -> the rank whose step it holds
        self.start(0.0)

    def start(self, now: float) -> None:
        """Every node's pod is (re)published at ``now`` and a new incarnation forms of them."""
        self.published, self.incarnation, self.rank_of = now, None, {}
        for node in self.slot:
            self.state.apply_report(self.report(node, held=node in self.data), now)
        self.state.tick(now + decide_interval(self.size))
        incarnation = self.state.job(KEY).incarnation
        self.incarnation = incarnation.incarnation_id
        self.rank_of = {node: rank for rank, node in incarnation.node_of_rank.items()}
        for rank, s in enumerate(self.settings):
            self.state.record_settings(KEY, self.incarnation, rank, s)

    def pod(self, node: str):
        rank = self.rank_of.get(node)
        incarnation = self.incarnation if rank is not None else None
        uid = f"uid-{node}-{self.published:g}"
        return pod_report(KEY, 0, self.slot[node], uid, incarnation, rank, nodes=self.size, published_at=self.published)

    def report(self, node: str, held: bool = False):
        if held and node not in self.data:
            self.data[node] = self.rank_of[node]
        steps = [HeldStep(*NAMES, STEP, self.data[node], files(self.data[node]))] if held else []
        return node_report(
            node,
            [self.pod(node)],
            steps,
            topology={"block": node},
            redundancy=self.redundancy,
            shards=tuple(self.shards.get(node, ())),
        )

    def round(self, now: float, nodes=None) -> dict[str, tuple[EncodeOrder, ...]]:
        """Every node (or ``nodes``) reports holding its own step, twice (the second replies carry the
        decisions of the first); returns each node's encode orders."""
        nodes = list(self.slot) if nodes is None else nodes
        for at in (now, now + 1.0):
            replies = {node: self.state.apply_report(self.report(node, held=True), at) for node in nodes}
            self.state.tick(at + decide_interval(self.size))
        return {node: self.state.reply_for(node).encode for node in replies}

    def build(self, node: str, orders: tuple[EncodeOrder, ...]) -> None:
        """Node ``node`` carries out its encode orders: it holds the shards of its positions' stripes."""
        for order in orders:
            layout = GroupLayout(tuple(m.rank for m in order.members), order.parity, order.stream_bytes)
            self.shards.setdefault(node, []).extend(
                HeldShard(
                    *NAMES,
                    order.step,
                    layout.members,
                    order.parity,
                    stripe,
                    index,
                    layout.segment_bytes,
                    f"{0xC0 + stripe:08x}",
                    redundancy.basis(tuple(m.digest or "" for m in order.members)),
                )
                for stripe, index in layout.held_by(order.position)
            )


def single(ranks: int) -> list[JobSettings]:
    """Data parallelism 1: every rank is encoded."""
    return [JobSettings((), 1, None, None)] * ranks


def encoded_job(state: ClusterState) -> Job:
    """Four ranks on xor:4 whose nodes hold step 5 and every shard of it."""
    job = Job(state, single(4))
    for node, orders in job.round(1.0).items():
        job.build(node, orders)
    job.round(5.0)
    return job


def test_a_mixed_job_encodes_only_the_ranks_without_a_data_parallel_peer_into_one_group():
    state = ClusterState()
    state.expire(0.0)
    # Ranks 0..3: data parallelism 2, 0<->2 and 1<->3 identical; ranks 4 and 5 have no peer.
    settings = [JobSettings(((r + 2) % 4,), 2, None, None) for r in range(4)] + [JobSettings((), 2, None, None)] * 2
    job = Job(state, settings)
    orders = job.round(1.0)
    node_of = {rank: node for node, rank in job.rank_of.items()}
    assert {node for node, o in orders.items() if o} == {node_of[4], node_of[5]}
    assert all(orders[node_of[r]] == () for r in range(4))
    sizes = (1000 + 8 * 4, 1000 + 8 * 5)
    for position, rank in enumerate((4, 5)):
        (order,) = orders[node_of[rank]]
        assert (order.step, order.position, order.parity, order.stream_bytes) == (STEP, position, 1, sizes)
        assert [(m.rank, m.node, m.url) for m in order.members] == [
            (4, node_of[4], f"http://{node_of[4]}"),
            (5, node_of[5], f"http://{node_of[5]}"),
        ]
    for node, o in orders.items():
        job.build(node, o)
    job.round(5.0)
    assert all(state.reply_for(node).encode == () for node in job.slot)  # built: no order again
    segment = GroupLayout((4, 5), 1, sizes).segment_bytes
    assert segment == 1040  # the longer stream (1040) over one data segment per stripe, a word multiple
    shards = [s for node in job.slot for s in job.shards.get(node, ())]
    assert sorted((s.members, s.stripe, s.index, s.bytes) for s in shards) == [
        ((4, 5), 0, 0, segment),
        ((4, 5), 1, 0, segment),
    ]
    assert sum(s.bytes for s in shards) == 2 * segment == 2080
    # A group of two under XOR costs what one full replica of each rank would (plus the padding to the
    # longer stream): cluster_ram 2 == 1 + 1 replica; the group of four xor:4 asks for would cost 4/3.
    replica_bytes = sum(sizes)
    assert replica_bytes == 2072 and sum(s.bytes for s in shards) - replica_bytes == 8
    assert cluster_ram(2, 1) == 2.0 and cluster_ram(4, 1) == 4 / 3
    assert str(parse("xor:4")) == "xor:4" and parity.parity_of(parse("xor:4"), (4, 5)) == 1


def test_under_xor_a_step_is_safe_only_once_every_node_holds_its_shard():
    state = ClusterState()
    state.expire(0.0)
    job = Job(state, single(4))
    orders = job.round(1.0)
    assert [len(orders[node]) for node in job.slot] == [1, 1, 1, 1]
    assert state.safe_step(KEY) is None  # every own node holds step 5, no shard yet
    now = 5.0
    for count, node in enumerate(job.slot, start=1):
        job.build(node, orders[node])
        state.apply_report(job.report(node, held=True), now)
        state.tick(now + decide_interval(4))
        now += 2.0
        assert state.safe_step(KEY) == (STEP if count == 4 else None), count


def test_shards_built_over_other_bytes_of_a_step_no_longer_count():
    """A rank's own node reports its step with other checksums (written again): the shards built over the old
    bytes stop counting, and the step is no longer safe nor decodable for any rank."""
    state = ClusterState()
    state.expire(0.0)
    job = Job(state, single(4))
    orders = job.round(1.0)
    for node in job.slot:
        job.build(node, orders[node])
        state.apply_report(job.report(node, held=True), 5.0)
    state.tick(5.0 + decide_interval(4))
    assert state.safe_step(KEY) == STEP
    assert {c.rank for c in state.copies(KEY) if c.decode} == {0, 1, 2, 3}
    node = next(n for n, r in job.rank_of.items() if r == 2)
    rewritten = HeldStep(*NAMES, STEP, 2, {"state/r2": (1016, "deadbeef")})
    state.apply_report(
        node_report(
            node,
            [job.pod(node)],
            [rewritten],
            topology={"block": node},
            redundancy=job.redundancy,
            shards=tuple(job.shards[node]),
        ),
        20.0,
    )
    state.tick(20.0 + decide_interval(4))
    assert state.safe_step(KEY) is None
    assert not [c for c in state.copies(KEY) if c.decode]


def test_a_silent_members_copy_within_its_grace_is_no_survivor_for_a_rebuild():
    """Three members of an rs:8:2 group fall silent: their copies stay restore sources for the grace period, but
    none counts as a survivor for a rebuild, so no decode is planned for them (K = 2 tolerates two)."""
    state = ClusterState()
    state.expire(0.0)
    job = Job(state, single(8), redundancy="rs:8:2")
    orders = job.round(1.0)
    for node in job.slot:
        job.build(node, orders[node])
        state.apply_report(job.report(node, held=True), 5.0)
    state.tick(5.0 + decide_interval(8))
    assert {c.rank for c in state.copies(KEY) if c.decode} == set(range(8))
    silent = [n for n, r in job.rank_of.items() if r in (1, 2, 3)]
    for now in (10.0, 15.0, 22.0):  # past the node timeout, within the grace period
        for node in job.slot:
            if node not in silent:
                state.apply_report(job.report(node, held=True), now)
        state.tick(now + decide_interval(8))
    assert {c.holder for c in state.copies(KEY) if not c.decode} >= set(silent)  # still restore sources
    assert not {1, 2, 3} & {c.rank for c in state.copies(KEY) if c.decode}


def lose(state: ClusterState, job: Job, lost: list[str]) -> int:
    """``lost`` fall silent past the grace period; fresh nodes take their slots and the job restarts.
    Returns the rank the first fresh node gets."""
    survivors = [n for n in job.slot if n not in lost]
    for now in (20.0, 40.0, 60.0):
        job.round(now, nodes=survivors)
    for node in lost:
        job.slot[f"f{node}"] = job.slot.pop(node)
    job.start(62.0)
    return job.rank_of[f"f{lost[0]}"]


def test_a_lost_rank_of_an_xor_group_is_planned_as_a_decode_from_its_three_survivors_and_shards():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    state.expire(0.0)
    job = encoded_job(state)
    assert state.safe_step(KEY) == STEP
    lost_rank = job.rank_of["n3"]
    rank = lose(state, job, ["n3"])
    assert rank == lost_rank  # ranks follow the data: the survivors keep theirs
    view = state.restore_view(KEY, job.incarnation, rank, 70.0)
    assert view.step == STEP
    (source,) = [s for s in view.sources if s.tier == Tier.DECODE]
    assert source.data_rank == rank and source.files == files(rank)
    recipe = source.recipe
    assert recipe is not None and recipe.parity == 1
    assert recipe.stream_bytes == tuple(1000 + 8 * r for r in range(4))
    survivors = {r: n for n, r in job.rank_of.items() if not n.startswith("f")}
    assert [(m.rank, m.node, m.url) for m in recipe.members] == [
        (r, survivors.get(r), f"http://{survivors[r]}" if r in survivors else None) for r in range(4)
    ]
    assert sorted(m.node for m in recipe.members if m.node) == ["n0", "n1", "n2"]
    assert [(c.stripe, c.index, c.node, c.url) for c in recipe.shards] == [
        (stripe, 0, f"n{stripe}", f"http://n{stripe}") for stripe in range(3)
    ]  # n3's shard (stripe 3) went with it


def test_two_lost_ranks_of_an_xor_group_get_no_decode_source():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    state.expire(0.0)
    job = encoded_job(state)
    rank = lose(state, job, ["n2", "n3"])
    view = state.restore_view(KEY, job.incarnation, rank, 70.0)
    assert all(s.tier != Tier.DECODE for s in view.sources)
    assert view.step is None and view.sources == ()  # no backup tier: a fresh start
    assert not [c for c in state.copies(KEY) if c.decode]
