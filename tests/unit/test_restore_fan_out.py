"""Identical data-parallel groups in the backup tier. Read-once restores: a step held only in the
backup tier is downloaded by one rank of each identical group, and its peers are told to wait for
that node, then to fetch from it; a silent downloader is not waited for. Shared uploads: each rank
of a group is ordered to upload its share; one whose files differ from its uploader's does not wait for it. The planner as a pure function, the rest through
``ClusterState``."""

from replicator.coordinator.planner import PlannedSource, StepCopy, Tier, plan_restore
from replicator.coordinator.state import ClusterState, decide_interval
from replicator.wire.messages import BackedUp, HeldStep, JobRef, JobSettings, NodeReport, PodReport
from tests.helpers.reports import node_report, pod_report

KEY = JobRef("default", "dp")
NAMES = (KEY.namespace, KEY.job)
FILES = {"_CHECKPOINT_METADATA": (10, "00000001"), "state/d/a": (30, "00000003")}
NODES, SLICES = 4, 2  # ranks 0 and 2 hold the same data, as do 1 and 3
IDENTICAL = {9: frozenset({(0, 2), (2, 0), (1, 3), (3, 1)})}


def backup_only(step=9):
    return [StepCopy.backed_up(step, rank) for rank in range(NODES)]


def test_one_rank_per_identical_group_downloads_a_backup_only_step_and_the_others_wait_for_its_node():
    node_of = {0: "a", 1: "b", 2: "c", 3: "d"}
    plan = plan_restore(
        NODES, node_of, backup_only(), block_of={"a": "b0", "b": "b0", "c": "b0", "d": "b1"}, identical=IDENTICAL
    )
    assert plan.step == 9
    assert plan.fan_out == {2: PlannedSource(Tier.PEER_CLOSE, "a", 0), 3: PlannedSource(Tier.PEER_DISTANT, "b", 1)}
    # Each downloader reads its own backup first; everyone keeps the store as a fallback.
    assert plan.sources[0][0] == PlannedSource(Tier.BACKUP, "backup", 0) and plan.sources[1][0] == PlannedSource(
        Tier.BACKUP, "backup", 1
    )
    assert all(s.tier == Tier.BACKUP for rank in range(NODES) for s in plan.sources[rank])


def test_no_fan_out_when_a_copy_is_in_the_cluster_without_identity_or_when_turned_off():
    node_of = {0: "a", 1: "b", 2: "c", 3: "d"}
    survived = [*backup_only(), StepCopy(9, 1, "b")]  # rank 1's node kept its copy: its group restores from it
    assert plan_restore(NODES, node_of, survived, identical=IDENTICAL).fan_out == {
        2: PlannedSource(Tier.PEER_DISTANT, "a", 0)
    }
    assert plan_restore(NODES, node_of, backup_only()).fan_out == {}  # identity unknown: every rank reads its own
    assert plan_restore(NODES, node_of, backup_only(), identical=IDENTICAL, fan_out=False).fan_out == {}


def test_copies_on_silent_nodes_do_not_keep_a_group_from_fanning_out():
    # After a cluster loss the lost nodes are silent, not yet forgotten: their copies stay sources, last.
    node_of = {0: "e", 1: "f", 2: "g", 3: "h"}
    lost = [*backup_only(), *(StepCopy(9, rank, old) for rank, old in enumerate("abcd"))]
    assert plan_restore(NODES, node_of, lost, identical=IDENTICAL).fan_out == {}
    plan = plan_restore(NODES, node_of, lost, identical=IDENTICAL, silent=frozenset("abcd"))
    assert plan.fan_out == {2: PlannedSource(Tier.PEER_DISTANT, "e", 0), 3: PlannedSource(Tier.PEER_DISTANT, "f", 1)}
    assert {s.holder for s in plan.sources[2]} == {"backup", "a", "c"}  # every source kept
    # A live node's copy still wins over the store for its group.
    assert plan_restore(NODES, node_of, lost, identical=IDENTICAL, silent=frozenset("abc")).fan_out == {
        2: PlannedSource(Tier.PEER_DISTANT, "e", 0)
    }


def pod(node, incarnation=None, rank=None, settings=None, published_at=0.0) -> PodReport:
    slice_index, worker = divmod(node % NODES, 2)  # a fresh node takes the slot of the lost one
    uid = f"uid-{node}"
    return pod_report(
        KEY,
        slice_index,
        worker,
        uid,
        incarnation,
        rank,
        settings,
        nodes=NODES,
        slices=SLICES,
        published_at=published_at,
    )


def report(node, pods=(), held=(), backed_up=()) -> NodeReport:
    return node_report(f"n{node}", pods, held, topology={"block": "b0"}, has_backup=True, backed_up=tuple(backed_up))


def identical_at_9(state: ClusterState, listing=(), files=lambda rank: FILES):
    """A DP=2 job whose ranks were found identical at step 9 (the backup tier lists ``listing``; rank r reports
    ``files(r)``). Returns (the incarnation, node index -> rank, the backup orders of the last report round)."""
    for node in range(NODES):
        state.apply_report(report(node, [pod(node)]), 0.0)
    state.tick(decide_interval(NODES))
    incarnation = state.job(KEY).incarnation
    rank_of = {int(node[1:]): rank for rank, node in incarnation.node_of_rank.items()}
    for rank in rank_of.values():
        state.restore.settings(
            KEY, incarnation.incarnation_id, rank, JobSettings(((rank + 2) % NODES,), SLICES, None, 100)
        )
    for now in (1.0, 2.0):  # the second round's replies carry the orders decided after the first
        orders = []
        for node, rank in rank_of.items():
            held = [HeldStep(*NAMES, 9, rank, files(rank), signature="sig-9")]
            orders += state.apply_report(
                report(node, [pod(node, incarnation.incarnation_id, rank)], held, listing), now
            ).backup
        state.tick(now + decide_interval(NODES))
    assert state.identical(KEY)[9]
    return incarnation, rank_of, orders


def test_identical_ranks_are_ordered_to_share_the_backup_upload_or_one_of_them_uploads():
    _, _, orders = identical_at_9(ClusterState(shared_backup=True))
    assert sorted((o.rank, o.share_group, o.dedup_from_rank) for o in orders) == [
        (0, (0, 2), None),
        (1, (1, 3), None),
        (2, (0, 2), None),
        (3, (1, 3), None),
    ]
    _, _, orders = identical_at_9(ClusterState())  # one leader per group, rotating with the step
    assert sorted((o.rank, o.share_group, o.dedup_from_rank) for o in orders) == [
        (0, (), 2),
        (1, (), 3),
        (2, (), None),
        (3, (), None),
    ]


def test_identical_ranks_whose_files_differ_upload_at_once_instead_of_after_their_groups_uploader():
    # Orbax: the same structure, each process's arrays in files of its own; only the small metadata file is equal.
    def per_process(rank):
        return {"_CHECKPOINT_METADATA": (10, "00000001"), f"state/ocdbt.process_{rank}/d/a": (30, f"0000000{rank + 3}")}

    _, _, orders = identical_at_9(ClusterState(), files=per_process)
    # Waiting for the uploader to deduplicate 10 of 40 bytes would put its whole upload before each rank's.
    assert sorted((o.rank, o.share_group, o.dedup_from_rank) for o in orders) == [
        (0, (), None),
        (1, (), None),
        (2, (), None),
        (3, (), None),
    ]
    # Most bytes equal (the metadata file larger than the rank's own): the rank waits, to reference them.
    _, _, orders = identical_at_9(
        ClusterState(), files=lambda rank: {**per_process(rank), "_CHECKPOINT_METADATA": (50, "00000001")}
    )
    assert sorted((o.rank, o.dedup_from_rank) for o in orders) == [(0, 2), (1, 3), (2, None), (3, None)]


def lost_cluster(state: ClusterState):
    """A DP=2 job whose ranks were found identical at step 9, backed up, then lost every copy in the
    cluster (the ramdisks are gone). Returns (incarnation id, rank -> node index)."""
    listing = BackedUp(*NAMES, ((9, 0),), 1.0)
    incarnation, rank_of, _ = identical_at_9(state, [listing])
    for node, rank in rank_of.items():
        state.apply_report(report(node, [pod(node, incarnation.incarnation_id, rank)], (), [listing]), 20.0)
    state.tick(20.0 + decide_interval(NODES))
    return incarnation.incarnation_id, {rank: node for node, rank in rank_of.items()}


def test_a_peer_waits_for_the_downloader_then_fetches_from_its_node_with_the_owner_checksums():
    state = ClusterState(node_timeout_seconds=15.0)
    incarnation, node_of = lost_cluster(state)
    now = 25.0
    views = {rank: state.restore.view(KEY, incarnation, rank, now) for rank in range(NODES)}
    assert {v.step for v in views.values()} == {9}
    assert [views[r].fan_out_pending for r in range(NODES)] == [False, False, True, True]
    assert all(s.tier == Tier.BACKUP for v in views.values() for s in v.sources)
    state.drain_changed()
    state.restore.staged(KEY, incarnation, views[0].generation, 0, "backup:backup")
    assert KEY in state.drain_changed()  # the waiting peer's long poll wakes up
    after = state.restore.view(KEY, incarnation, 2, now)
    assert not after.fan_out_pending and after.token != views[2].token
    first = after.sources[0]
    assert (first.tier, first.holder, first.url, first.data_rank) == (
        Tier.PEER_CLOSE,
        f"n{node_of[0]}",
        f"http://n{node_of[0]}",
        0,
    )
    assert first.files == FILES  # what rank 0's own node reported, not whatever the downloader holds
    assert after.sources[1].tier == Tier.BACKUP  # the fallback
    assert state.restore.view(KEY, incarnation, 3, now).fan_out_pending  # rank 1 has not staged yet


def test_a_silent_downloader_is_not_waited_for():
    state = ClusterState(node_timeout_seconds=15.0)
    incarnation, node_of = lost_cluster(state)
    assert state.restore.view(KEY, incarnation, 3, 25.0).fan_out_pending
    for rank in (0, 2, 3):  # rank 1's node (the downloader of rank 3) falls silent
        state.apply_report(report(node_of[rank], [pod(node_of[rank], incarnation, rank)]), 60.0)
    state.drain_changed()
    state.tick(60.0)
    assert KEY in state.drain_changed()  # the change reaches the waiting rank's long poll
    view = state.restore.view(KEY, incarnation, 3, 60.0)
    assert not view.fan_out_pending and [s.tier for s in view.sources] == [Tier.BACKUP, Tier.BACKUP]


def test_a_cluster_replaced_whole_keeps_the_identities_of_its_backups_until_a_new_lister_lists():
    state = ClusterState(node_timeout_seconds=4.0, holder_grace_seconds=5.0)
    listing = BackedUp(*NAMES, ((9, 0),), 1.0)
    identical_at_9(state, [listing])
    # Every node is lost; fresh nodes 4..7 publish the job's new pods and report nothing held, not
    # listed yet: the lost nodes (the only listers) are forgotten past the grace meanwhile.
    for now in (3.0, 10.0, 20.0):
        for node in range(NODES, 2 * NODES):
            state.apply_report(report(node, [pod(node, published_at=3.0)]), now)
        state.tick(now + decide_interval(NODES))
    incarnation = state.job(KEY).incarnation
    assert set(incarnation.node_of_rank.values()) == {f"n{node}" for node in range(NODES, 2 * NODES)}
    assert not state.backed_up(KEY) and state.identical(KEY)[9]  # backups unknown, identities kept
    node_of = {rank: int(node[1:]) for rank, node in incarnation.node_of_rank.items()}
    for rank, node in node_of.items():
        state.restore.settings(
            KEY, incarnation.incarnation_id, rank, JobSettings(((rank + 2) % NODES,), SLICES, None, 100)
        )
        state.apply_report(
            report(node, [pod(node, incarnation.incarnation_id, rank, published_at=3.0)], (), [listing]), 21.0
        )
    state.tick(21.0 + decide_interval(NODES))
    views = {rank: state.restore.view(KEY, incarnation.incarnation_id, rank, 22.0) for rank in range(NODES)}
    assert {v.step for v in views.values()} == {9}
    assert [views[r].fan_out_pending for r in range(NODES)] == [False, False, True, True]


def test_a_replan_after_the_only_lister_was_lost_waits_for_a_new_listing_instead_of_starting_fresh():
    """Nodes 1-3 listed the backup tier (step 5); node 0's listing is older, from before that backup. Nodes 1-3
    are lost while their copies of step 9 are still within the grace period, so the restore plans step 9 from
    them. Past the grace they are forgotten with their listings: node 0's stale one is not believed either, and
    the replan waits for a new listing, then plans the backup, never a fresh start."""
    import pytest

    from replicator.coordinator.planning.restores import NotReady

    state = ClusterState(node_timeout_seconds=4.0, holder_grace_seconds=5.0)
    listing, stale = BackedUp(*NAMES, ((5, 0),), 1.0), BackedUp(*NAMES, (), 0.5)
    single = JobSettings((), 1, None, 100)
    for node in range(NODES):
        state.apply_report(report(node, [pod(node)]), 0.0)
    state.tick(decide_interval(NODES))
    first = state.job(KEY).incarnation
    rank_of = {int(node[1:]): rank for rank, node in first.node_of_rank.items()}
    for rank in rank_of.values():
        state.restore.settings(KEY, first.incarnation_id, rank, single)
    for now in (1.0, 2.0):
        for node, rank in rank_of.items():
            held = [HeldStep(*NAMES, 9, rank, FILES)]
            listed = [listing] if node else [stale]
            state.apply_report(report(node, [pod(node, first.incarnation_id, rank)], held, listed), now)
        state.tick(now + decide_interval(NODES))
    assert state.backed_up(KEY) == {5}
    # Nodes 1-3 are lost; node 0 and fresh nodes 4-6 publish the job's new pods.
    survivors = [0, 4, 5, 6]
    for now in (3.0, 3.5):
        for node in survivors:
            state.apply_report(
                report(node, [second_pod(node)], rank_held(node, rank_of), [stale] if node == 0 else []), now
            )
        state.tick(now + decide_interval(NODES))
    incarnation = state.job(KEY).incarnation
    assert incarnation.incarnation_id != first.incarnation_id
    node_of = {rank: int(node[1:]) for rank, node in incarnation.node_of_rank.items()}
    lost_rank = next(rank for rank, node in node_of.items() if node == 4)
    for rank, node in node_of.items():
        state.restore.settings(KEY, incarnation.incarnation_id, rank, single)
        state.apply_report(
            report(
                node,
                [second_pod(node, incarnation.incarnation_id, rank)],
                rank_held(node, rank_of),
                [stale] if node == 0 else [],
            ),
            3.6,
        )
    state.tick(3.6 + decide_interval(NODES))
    assert state.restore.view(KEY, incarnation.incarnation_id, lost_rank, 4.1).step == 9  # its lost node's copy
    for now in (6.0, 9.0, 12.0):  # the lost nodes fall silent past the grace and are forgotten
        for rank, node in node_of.items():
            pods = [second_pod(node, incarnation.incarnation_id, rank)]
            state.apply_report(report(node, pods, rank_held(node, rank_of), [stale] if node == 0 else []), now)
        state.tick(now + decide_interval(NODES))
    assert not state.backed_up(KEY)  # the newest listings went with their nodes, node 0's stale one with them
    with pytest.raises(NotReady, match="list the backup tier"):
        state.restore.view(KEY, incarnation.incarnation_id, lost_rank, 12.5)
    for rank, node in node_of.items():  # the new lister lists
        pods = [second_pod(node, incarnation.incarnation_id, rank)]
        new = BackedUp(*NAMES, ((5, 0),), 13.0)
        state.apply_report(report(node, pods, rank_held(node, rank_of), [new] if node == 0 else []), 13.0)
    state.tick(13.0 + decide_interval(NODES))
    view = state.restore.view(KEY, incarnation.incarnation_id, lost_rank, 13.5)
    assert view.step == 5 and [s.tier for s in view.sources] == [Tier.BACKUP]


def rank_held(node: int, rank_of: dict[int, int]) -> list[HeldStep]:
    """Node 0 keeps its rank's step 9; fresh nodes hold nothing."""
    return [HeldStep(*NAMES, 9, rank_of[node], FILES)] if node in rank_of else []


def second_pod(node: int, incarnation=None, rank=None) -> PodReport:
    """The job's pod of its second incarnation on ``node`` (published at 3.0), in the slot of the lost one."""
    slice_index, worker = divmod(node % NODES, 2)
    return pod_report(
        KEY, slice_index, worker, f"uid-{node}-2", incarnation, rank, nodes=NODES, slices=SLICES, published_at=3.0
    )
