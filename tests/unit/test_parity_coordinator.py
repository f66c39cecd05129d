"""Erasure-coded redundancy (issue 41) in the coordinator's state, driven by hand-built node reports (no HTTP):
which ranks are grouped and ordered to encode, the parity bytes a group costs, when a step is safe, and the
restore plan of a lost rank (a ``Tier.DECODE`` source with its recipe)."""

import msgspec
import pytest
from prometheus_client import REGISTRY

from replicator.coordinator import planner
from replicator.coordinator.api.recovery_snapshot import RecoverySnapshot
from replicator.coordinator.planning import parity
from replicator.coordinator.state import ClusterState, decide_interval
from replicator.parity.layout import GroupLayout, cluster_ram
from replicator.wire import redundancy
from replicator.wire.messages import BackedUp, EncodeOrder, HeldShard, HeldStep, JobRef, JobSettings, Tier
from replicator.wire.redundancy import parse
from tests.helpers.reports import node_report, pod_report

KEY = JobRef("default", "ec")
NAMES = (KEY.namespace, KEY.job)
STEP = 5


def files(rank: int, step: int = STEP) -> dict[str, tuple[int, str]]:
    """Rank ``rank``'s ``step``: streams of unequal length (the group pads to the longest), other bytes each step."""
    return {f"state/r{rank}": (1000 + 8 * rank, f"{step << 8 | rank + 1:08x}")}


class Job:
    """A job of ``len(settings)`` ranks, one per node ``n<i>`` (own topology block), nodes on ``xor:4``."""

    def __init__(self, state: ClusterState, settings: list[JobSettings], redundancy: str = "xor:4"):
        self.state, self.settings, self.redundancy = state, settings, redundancy
        self.size = len(settings)
        self.slot = {f"n{i}": i for i in range(self.size)}
        self.shards: dict[str, list[HeldShard]] = {}
        self.data: dict[str, int] = {}  # node -> the rank whose steps it holds
        self.steps: tuple[int, ...] = (STEP,)  # the steps every node holds
        self.written_again: dict[int, dict[str, tuple[int, str]]] = {}  # rank -> its step's other checksums
        self.backups: tuple[int, ...] = ()  # the steps every node lists complete in its backup tier (timeline 0)
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
            self.state.restore.settings(KEY, self.incarnation, rank, s)

    def pod(self, node: str):
        rank = self.rank_of.get(node)
        incarnation = self.incarnation if rank is not None else None
        uid = f"uid-{node}-{self.published:g}"
        return pod_report(KEY, 0, self.slot[node], uid, incarnation, rank, nodes=self.size, published_at=self.published)

    def report(self, node: str, held: bool = False):
        if held and node not in self.data:
            self.data[node] = self.rank_of[node]
        rank = self.data.get(node)
        steps = (
            [HeldStep(*NAMES, step, rank, self.written_again.get(rank) or files(rank, step)) for step in self.steps]
            if held and rank is not None
            else []
        )
        listing = (BackedUp(*NAMES, tuple((step, 0) for step in self.backups), 1.0),) if self.backups else ()
        return node_report(
            node,
            [self.pod(node)],
            steps,
            topology={"block": node},
            redundancy=self.redundancy,
            shards=tuple(self.shards.get(node, ())),
            has_backup=bool(self.backups),
            backed_up=listing,
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
            layout = GroupLayout.of_group(order)
            self.shards.setdefault(node, []).extend(
                HeldShard(
                    namespace=KEY.namespace,
                    job=KEY.job,
                    step=order.step,
                    members=layout.members,
                    parity=order.parity,
                    stripe=stripe,
                    index=index,
                    bytes=layout.segment_bytes,
                    crc32c=f"{0xC0 + stripe:08x}",
                    basis=redundancy.basis(tuple(m.digest or "" for m in order.members)),
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


def test_the_jobs_setting_follows_its_nodes_redundancy_within_an_incarnation_and_is_replicas_when_they_disagree():
    # The nodes' settings are kept between decision passes: nodes that restart with another ``--redundancy`` in
    # the same incarnation must still change the job's.
    state = ClusterState()
    job = Job(state, single(4), redundancy="replicas")
    assert not any(job.round(1.0).values())  # full replicas: no parity
    job.redundancy = "xor:4"
    job.round(3.0, nodes=["n0"])
    assert not any(state.reply_for(node).encode for node in job.slot)  # n1-n3 still say replicas
    orders = job.round(5.0)
    assert state.job(KEY).incarnation.incarnation_id == job.incarnation
    assert all(orders.values()) and {o.step for node in orders for o in orders[node]} == {STEP}


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
    bytes stop counting, and the step is no longer safe nor decodable for any rank. The step is the round again:
    every member is ordered anew over the new bytes."""
    state = ClusterState()
    state.expire(0.0)
    job = Job(state, single(4))
    orders = job.round(1.0)
    for node in job.slot:
        job.build(node, orders[node])
        state.apply_report(job.report(node, held=True), 5.0)
    state.tick(5.0 + decide_interval(4))
    assert state.safe_step(KEY) == STEP
    assert {c.rank for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE} == {0, 1, 2, 3}
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
    assert not [c for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE]
    new_digest = redundancy.files_digest(rewritten.files)
    for n in job.slot:
        (order,) = state.reply_for(n).encode
        assert (order.step, order.members[2].digest) == (STEP, new_digest)


def forged_shards(job: Job, steps: tuple[int, ...]) -> list[HeldShard]:
    """Every shard of the one group of ``job``'s ranks at ``steps``, over the members' current checksums: what a
    member would claim to fill every slot ``parity.safe`` counts (the digests are in the orders it gets)."""
    group, parity = tuple(range(job.size)), parity_of_job(job)
    found = []
    for step in steps:
        basis = redundancy.basis(tuple(redundancy.files_digest(files(rank, step)) for rank in group))
        found += [
            HeldShard(
                namespace=KEY.namespace,
                job=KEY.job,
                step=step,
                members=group,
                parity=parity,
                stripe=stripe,
                index=index,
                bytes=1040,
                crc32c="0badc0de",
                basis=basis,
            )
            for stripe in range(job.size)
            for index in range(parity)
        ]
    return found


def parity_of_job(job: Job) -> int:
    return parity.parity_of(parse(job.redundancy), tuple(range(job.size)))


def unordered_shards() -> float:
    return REGISTRY.get_sample_value("mtc_coordinator_unordered_shards_total") or 0.0


# Under rs:4:2 the member's own two shards of step 5 (stripes 0 and 3) and the three live members truly rebuild
# rank 2 (its stripes 3 and 0 each need one shard more than its one live co-contributor); under xor none.
@pytest.mark.parametrize(("setting", "decodable_by_its_own"), [("xor:4", set()), ("rs:4:2", {2})])
def test_a_member_claiming_shards_it_was_not_ordered_to_build_makes_no_step_safe_and_gc_keeps_older_steps(
    setting, decodable_by_its_own
):
    """Step 3 is encoded and safe. Steps 4 and 5 are committed everywhere and only 5 is ordered (the round). One
    member builds its own shards of 5 and claims every other slot of 5 (other stripes' shards; under rs:4:2 also
    another member's index of its own stripe) and every slot of 4 (a step, and so a basis, it was never ordered
    for), all over the members' real checksums. No step becomes safe past 3, GC keeps from 3, nothing is decodable
    at 4 and at 5 only what its own shards rebuild, and the claims are counted. Once the other members build
    theirs, 5 is safe."""
    state = ClusterState()
    state.expire(0.0)
    job = Job(state, single(4), redundancy=setting)
    job.steps = (3,)
    for node, orders in job.round(1.0).items():
        job.build(node, orders)
    job.round(3.0)
    assert state.safe_step(KEY) == 3
    job.steps = (3, 4, 5)
    orders = job.round(5.0)
    assert {(o.step, o.position) for o in orders["n0"]} == {(5, job.rank_of["n0"])}
    assert {o.step for node in job.slot for o in orders[node]} == {5}  # step 4 is never ordered
    before = unordered_shards()
    job.build("n0", orders["n0"])
    own = {(s.step, s.stripe, s.index) for s in job.shards["n0"]}  # its shards of steps 3 and 5
    job.shards["n0"] += [s for s in forged_shards(job, (4, 5)) if (s.step, s.stripe, s.index) not in own]
    slots = 4 * parity_of_job(job)
    assert len([s for s in job.shards["n0"] if s.step in (4, 5)]) == 2 * slots  # every slot of steps 4 and 5
    job.round(7.0)
    assert state.safe_step(KEY) == 3
    assert {state.reply_for(node).retain[0].keep_from for node in job.slot} == {3}
    assert job.rank_of["n0"] == 0
    assert {(c.step, c.rank) for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE} == {
        (3, r) for r in range(4)
    } | {(5, r) for r in decodable_by_its_own}
    assert unordered_shards() - before == 2 * slots - parity_of_job(job)  # all but its own of step 5
    for node in ("n1", "n2", "n3"):  # the honest path: the ordered members build theirs
        job.build(node, orders[node])
    job.round(9.0)
    assert state.safe_step(KEY) == 5
    assert {state.reply_for(node).retain[0].keep_from for node in job.slot} == {5}
    decodable = {(c.step, c.rank) for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE}
    assert {step for step, _ in decodable} == {3, 5}  # never 4: its shards are n0's word alone


def test_a_restarted_coordinator_counts_the_shards_already_built_only_for_the_step_it_orders_again():
    """The nodes hold every shard of steps 3 and 5 when a new coordinator starts (orders forgotten). It believes
    none until its first pass orders its round's step, 5, again: the shards already built for that order count
    (nothing is rebuilt) and 5 is safe; step 3's shards, never ordered by it, count for nothing."""
    state = ClusterState()
    state.expire(0.0)
    job = Job(state, single(4))
    for step in (3, 5):
        job.steps = (step,) if step == 3 else (3, 5)
        for node, orders in job.round(float(step)).items():
            job.build(node, orders)
        job.round(step + 1.0)
        assert state.safe_step(KEY) == step
    restarted = ClusterState()
    restarted.expire(10.0)
    for rank, s in enumerate(job.settings):
        restarted.restore.settings_from_snapshot(KEY, rank, s)  # the settings snapshot
    job.state = restarted
    first = {node: restarted.apply_report(job.report(node, held=True), 10.0) for node in job.slot}
    assert all(reply.encode == () for reply in first.values())
    assert restarted.job(KEY).incarnation.incarnation_id == job.incarnation  # adopted from the pods' reports
    before = unordered_shards()
    replies = job.round(11.0)
    assert all(orders == () for orders in replies.values())  # every shard of the order is held already
    assert restarted.safe_step(KEY) == 5
    assert {c.step for c in restarted.copies(KEY) if c.kind is planner.CopyKind.DECODE} == {5}
    assert unordered_shards() == before  # a restart's shards are not hostile claims


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
    assert {c.rank for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE} == set(range(8))
    silent = [n for n, r in job.rank_of.items() if r in (1, 2, 3)]
    for now in (10.0, 15.0, 22.0):  # past the node timeout, within the grace period
        for node in job.slot:
            if node not in silent:
                state.apply_report(job.report(node, held=True), now)
        state.tick(now + decide_interval(8))
    assert {c.holder for c in state.copies(KEY) if c.kind is not planner.CopyKind.DECODE} >= set(
        silent
    )  # still restore sources
    assert not {1, 2, 3} & {c.rank for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE}


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
    view = state.restore.view(KEY, job.incarnation, rank, 70.0)
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
    view = state.restore.view(KEY, job.incarnation, rank, 70.0)
    assert all(s.tier != Tier.DECODE for s in view.sources)
    assert view.step is None and view.sources == ()  # no backup tier: a fresh start
    assert not [c for c in state.copies(KEY) if c.kind is planner.CopyKind.DECODE]


def restart(state_dir: str | None, old: ClusterState, job: Job, now: float, seen: dict[int, float] | None = None):
    """The coordinator is SIGKILLed and started again on ``state_dir`` (None: it has none): all that is left of
    ``old`` is what its recovery snapshot last wrote there (with ``seen``: it had also seen those backups), and its
    settings snapshot."""
    if state_dir is not None:
        written = RecoverySnapshot(state_dir)
        jobs = written.collect(old, 0.0)
        if seen:
            jobs = [msgspec.structs.replace(j, backup=msgspec.structs.replace(j.backup, seen=seen)) for j in jobs]
        written.write(jobs)
    restarted = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    restarted.expire(now)
    for rank, s in enumerate(job.settings):
        restarted.restore.settings_from_snapshot(KEY, rank, s)
    RecoverySnapshot(state_dir).load(restarted)
    job.state = restarted
    return restarted


@pytest.mark.parametrize("redundancy, lost", [("xor:4", ["n3"]), ("rs:4:2", ["n1", "n3"])])
@pytest.mark.parametrize("kept", [True, False], ids=["state-dir", "no-state-dir"])
def test_a_coordinator_restarted_after_a_node_loss_plans_the_lost_ranks_as_decodes_from_what_it_kept(
    tmp_path, redundancy, lost, kept
):
    """Issue 49: the group's nodes lose ``lost`` (they never report again), then the coordinator restarts. The lost
    ranks' checksums and the shards' encode orders come back from the state dir, and each lost rank is planned as a
    decode with its own checksums. Its first decision pass runs before any report, believing an older backup: what
    was kept is not forgotten before the survivors report it. Without a state dir nothing brings them back: no
    decode, a fresh start."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    state.expire(0.0)
    job = Job(state, single(4), redundancy=redundancy)
    for node, orders in job.round(1.0).items():
        job.build(node, orders)
    job.round(5.0)
    assert state.safe_step(KEY) == STEP
    lost_ranks = sorted(job.rank_of[n] for n in lost)
    restarted = restart(str(tmp_path) if kept else None, state, job, 10.0, seen={3: 1.0})
    restarted.tick(11.0)  # a decision pass before any report
    survivors = [n for n in job.slot if n not in lost]
    for node in lost:
        job.slot[f"f{node}"] = job.slot.pop(node)
    job.start(12.0)
    assert sorted(job.rank_of[f"f{n}"] for n in lost) == lost_ranks  # ranks follow the data
    job.round(30.0, nodes=survivors)
    for node in lost:
        restarted.apply_report(job.report(f"f{node}"), 31.0)
    for rank in lost_ranks:
        view = restarted.restore.view(KEY, job.incarnation, rank, 31.0)
        if not kept:
            assert view.step is None and view.sources == ()
            continue
        assert view.step == STEP
        (source,) = [s for s in view.sources if s.tier == Tier.DECODE]
        assert source.data_rank == rank and source.files == files(rank)
        assert source.recipe is not None and {m.node for m in source.recipe.members} >= set(survivors)


def test_checksums_kept_in_the_state_dir_lose_to_the_ranks_own_report_after_a_restart(tmp_path):
    """A rank wrote its step again while the coordinator was down: its own node's report wins over the checksums
    kept, and the step's old shards (over the old checksums) count no more."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    state.expire(0.0)
    job = encoded_job(state)
    restarted = restart(str(tmp_path), state, job, 10.0)
    rank = job.rank_of["n2"]
    assert restarted.job(KEY).owner_files(STEP, rank) == files(rank)  # kept
    job.written_again[rank] = {f"state/r{rank}": (1000 + 8 * rank, "0badbeef")}
    job.round(11.0)
    assert restarted.job(KEY).owner_files(STEP, rank) == job.written_again[rank]
    assert not [c for c in restarted.copies(KEY) if c.kind is planner.CopyKind.DECODE]


# A failed decode and a lost holder (issue 49): the chaos row "flipped byte in a parity shard, then the node of a
# rank whose rebuild needs it lost". n3 holds rank 3's step 5 and stops reporting at ``LOST_AT``; a fresh node takes
# its slot at once. The coordinator runs with a 15 s node timeout and a 60 s holder grace period.
LOST_AT = 6.0  # n3's last report: ``encoded_job``'s last round reports at 5 and 6


def lost_n3(state: ClusterState, backups: tuple[int, ...]) -> tuple[Job, int]:
    """``encoded_job`` whose nodes list ``backups`` complete; n3 lost after ``LOST_AT``, fn3 in its slot, the job
    restarted a second later. Returns the job and fn3's rank (n3's)."""
    state.expire(-state.liveness.node_timeout_seconds)  # the coordinator has run a node timeout before the job
    job = Job(state, [JobSettings((), 1, None, 100)] * 4)  # backed up every 100 steps: no new backup here
    job.backups = backups
    for node, orders in job.round(1.0).items():
        job.build(node, orders)
    job.round(5.0)
    assert state.safe_step(KEY) == STEP and state.backed_up(KEY) == set(backups)
    job.slot["fn3"] = job.slot.pop("n3")
    job.start(LOST_AT + 1)
    return job, job.rank_of["fn3"]


def heard(state: ClusterState, job: Job, now: float) -> None:
    """Every node of the job reports at ``now`` (n3 is gone); the coordinator's clock runs to ``now``."""
    for node in job.slot:
        state.apply_report(job.report(node, held=node in job.data), now)
    state.tick(now)


def decode_fails(state: ClusterState, job: Job, rank: int, now: float):
    """The rank's first view: step 5 from n3 (not silent yet) or a decode. n3 does not answer and the rebuilt bytes
    fail the owner's checksums, as the agent reports it (the unreachable one is retried). Returns the view."""
    view = state.restore.view(KEY, job.incarnation, rank, now)
    assert view.step == STEP and [(s.tier, s.holder) for s in view.sources] == [
        (Tier.PEER_DISTANT, "n3"),
        (Tier.DECODE, planner.DECODE_HOLDER),
    ]
    state.restore.staged(KEY, job.incarnation, view.generation, rank, None, [(STEP, rank, planner.DECODE_HOLDER)], True)
    return view


def test_a_failed_decode_restores_the_backup_once_the_lost_holder_falls_silent_not_after_its_grace_period():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    job, rank = lost_n3(state, backups=(1,))
    first = decode_fails(state, job, rank, LOST_AT + 2)
    now, woken = LOST_AT + 2, []
    while (view := state.restore.view(KEY, job.incarnation, rank, now)).step == STEP:
        assert now - LOST_AT < state.liveness.holder_grace_seconds, "waited out the lost holder's grace period"
        now += 1.0
        state.drain_changed()
        heard(state, job, now)
        woken.append(KEY in state.drain_changed())  # the rank's long poll asks again
    # Replanned once n3 fell silent: the node timeout, plus the coordinator's 1 s expiry pass and this 1 s clock. The
    # pass that found n3 silent woke the waiting rank's long poll, and none before it.
    assert now - LOST_AT <= state.liveness.node_timeout_seconds + 2.0, now - LOST_AT
    assert woken[-1] and not any(woken[:-1]), woken
    assert view.generation != first.generation and view.step == 1
    assert [(s.tier, s.holder) for s in view.sources] == [(Tier.BACKUP, "backup")]
    assert {state.restore.view(KEY, job.incarnation, r, now).step for r in range(4)} == {1}


def test_a_lost_holder_that_alone_can_serve_is_waited_for_within_its_grace_period_and_the_plan_stays():
    """No backup: nothing restores without n3, so its grace applies; asking again changes no plan."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    job, rank = lost_n3(state, backups=())
    first = decode_fails(state, job, rank, LOST_AT + 2)
    for now in range(int(LOST_AT) + 3, int(LOST_AT + state.liveness.holder_grace_seconds)):
        heard(state, job, float(now))
        view = state.restore.view(KEY, job.incarnation, rank, float(now))
        assert view.generation == first.generation and {s.holder for s in view.sources} == {"n3", "parity"}
    heard(state, job, LOST_AT + state.liveness.holder_grace_seconds + 2)
    assert state.restore.view(KEY, job.incarnation, rank, LOST_AT + 62).step is None  # given up: a fresh start


def test_a_silent_node_of_the_incarnation_keeps_a_lost_holder_waited_for_and_its_return_makes_the_step_decodable():
    """n2 (a survivor) is frozen while n3 is lost: rank 3 cannot be rebuilt without n2's copy, and the restore waits
    for n2 anyway, so the plan keeps n3 rather than rolling back to the backup; n2 back, rank 3 decodes step 5."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    job, rank = lost_n3(state, backups=(1,))
    frozen = job.slot.pop("n2")
    for now in range(int(LOST_AT) + 2, int(LOST_AT) + 20):  # both silent past the node timeout
        heard(state, job, float(now))
    view = state.restore.view(KEY, job.incarnation, rank, LOST_AT + 19)
    assert view.step == STEP and [s.holder for s in view.sources] == ["n3"]
    job.slot["n2"] = frozen
    heard(state, job, LOST_AT + 20)
    view = state.restore.view(KEY, job.incarnation, rank, LOST_AT + 20)
    assert view.step == STEP and [(s.tier, s.holder) for s in view.sources] == [(Tier.DECODE, planner.DECODE_HOLDER)]


def test_the_step_restored_in_place_of_a_safe_step_whose_copy_proved_corrupt_stays_protected_once_staged():
    """Steps 1 and 5 are backed up; rank 3's backup of 5 is corrupt and n3 is lost. Step 5 stays safe by what the
    coordinator believes (backed up, copies on live nodes), so once every rank staged step 1 "a newer step is safe"
    held, and the nodes' garbage collection deleted step 1 under the restore markers (a chaos run, xor, started
    fresh). It stays protected until a step newer than the one passed over is safe."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    job, rank = lost_n3(state, backups=(1, STEP))
    view = state.restore.view(KEY, job.incarnation, rank, LOST_AT + 2)
    assert view.step == STEP
    state.restore.staged(
        KEY, job.incarnation, view.generation, rank, None, [(STEP, rank, s.holder) for s in view.sources]
    )
    views = {r: state.restore.view(KEY, job.incarnation, r, LOST_AT + 3) for r in range(4)}
    assert {v.step for v in views.values()} == {1}
    for r, v in views.items():
        state.restore.staged(KEY, job.incarnation, v.generation, r, "backup:backup")
    heard(state, job, LOST_AT + 4)
    assert state.restore.view(KEY, job.incarnation, rank, LOST_AT + 4).ready
    assert state.safe_step(KEY) == STEP  # believed: the corrupt backup and the other ranks' copies
    retain = state.job(KEY).retain
    assert retain is not None and retain.keep_from == STEP and 1 in retain.protected
