"""The backup schedule through failures, as the coordinator decides it from reports (no HTTP, no processes): a backup
survives a preemption, one that a node loss stranded is replaced at once, and the backup lag it exports."""

import msgspec
import pytest

from replicator.coordinator.api.cluster_gauges import exposition
from replicator.coordinator.api.recovery_snapshot import RecoverySnapshot
from replicator.coordinator.indices.job import StandIn
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import CRC32C_RESIDUE, BackedUp, HeldStep, JobSettings, files_digest
from tests.helpers.coordinator import KEY, NAMES, OWN, SETTINGS, report
from tests.helpers.reports import pod_report


def pod(index, uid, incarnation=None, rank=None):
    return pod_report(KEY, 0, index, uid, incarnation, rank, SETTINGS if rank is not None else None, nodes=2)


def own(step, rank):
    return HeldStep(*NAMES, step, rank, OWN[rank])


def replica(step, rank):
    return HeldStep(*NAMES, step, rank, OWN[rank], replica=True)


def form(state, nodes, uids, now, settings=SETTINGS, held=None):
    """The job's pods ``uids`` on ``nodes`` (index i on nodes[i]) form an incarnation; returns (its id, node -> rank).
    ``settings``: every rank's, or rank -> its own. ``held``: node -> the steps it reports with its pod (default: none)."""
    for index, (node, uid) in enumerate(zip(nodes, uids, strict=True)):
        holding = (held or {}).get(node, [])
        reply = state.apply_report(report(node, f"http://{node}", [pod(index, uid)], holding, has_backup=True), now)
    incarnation = reply.assignments[0].incarnation
    rank_of_pod = state.job(KEY).incarnation.rank_of_pod
    rank_of = {node: rank_of_pod[uid] for node, uid in zip(nodes, uids, strict=True)}
    for node in nodes:
        rank = rank_of[node]
        state.restore.settings(KEY, incarnation, rank, settings[rank] if isinstance(settings, dict) else settings)
    return incarnation, rank_of


def heartbeat(state, node, index, uid, incarnation, rank, held, now):
    return state.apply_report(
        report(node, f"http://{node}", [pod(index, uid, incarnation, rank)], held, has_backup=True), now
    )


def saved_everywhere(state, incarnation, rank_of, steps, now, replicated=None, uids=("uid0", "uid1")):
    """Nodes a and b (pods ``uids``) report their own ``steps`` and the other rank's replicas of ``replicated``
    (default: the same steps). Returns the backup orders of the replies."""
    orders = []
    for index, node in enumerate(("a", "b")):
        other = rank_of["b" if node == "a" else "a"]
        held = [own(s, rank_of[node]) for s in steps] + [replica(s, other) for s in replicated or steps]
        orders += heartbeat(state, node, index, uids[index], incarnation, rank_of[node], held, now).backup
    return orders


def test_a_backup_chosen_before_a_preemption_keeps_its_upload_tag_so_ranks_uploaded_before_it_count():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [5], 1.0)  # each holds its own step 5 and the other's replica
    state.tick(2.0)
    assert state.job(KEY).backup_pending == 5
    tags = {
        o.incarnation for o in heartbeat(state, "a", 0, "uid0", first, rank_of["a"], [own(5, rank_of["a"])], 2.0).backup
    }
    assert len(tags) == 1 and next(iter(tags)).startswith(f"{first}-")
    (tag,) = tags

    # A preemption: new pods on the same nodes, a new incarnation; the nodes still hold step 5.
    second, rank_of = form(state, ("a", "b"), ("uid2", "uid3"), 10.0)
    assert second != first
    orders = saved_everywhere(state, second, rank_of, [5], 11.0, uids=("uid2", "uid3"))
    state.tick(12.0)
    assert state.job(KEY).backup_pending == 5
    # The orders of the new incarnation tag the uploads as the first did: COMMIT joins ranks uploaded before it.
    assert sorted((o.step, o.rank, o.incarnation) for o in orders) == [(5, 0, tag), (5, 1, tag)]


def test_a_backup_stranded_by_a_node_loss_is_replaced_at_once_by_a_newer_complete_step():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [5], 1.0)
    state.tick(2.0)
    assert state.job(KEY).backup_pending == 5
    saved_everywhere(state, first, rank_of, [5, 8], 3.0)  # step 8 is saved and replicated meanwhile
    state.tick(4.0)

    # Node b is lost mid-backup; a fresh node c takes its rank and restores step 8 (from a's replica), not step 5.
    lost_rank = rank_of["b"]
    state.expire(100.0)
    second, rank_of = form(state, ("a", "c"), ("uid2", "uid3"), 100.0)
    assert rank_of["c"] == lost_rank
    heartbeat(
        state,
        "a",
        0,
        "uid2",
        second,
        rank_of["a"],
        [own(5, rank_of["a"]), own(8, rank_of["a"]), replica(8, lost_rank)],
        101.0,
    )
    heartbeat(state, "c", 1, "uid3", second, lost_rank, [own(8, lost_rank)], 101.0)
    state.tick(102.0)
    # Not after the 600 s give-up: step 5 can never complete (rank lost_rank's node holds no copy of it).
    assert state.job(KEY).backup_pending == 8
    orders = heartbeat(state, "c", 1, "uid3", second, lost_rank, [own(8, lost_rank)], 103.0).backup
    assert [(o.step, o.rank) for o in orders] == [(8, lost_rank)] and orders[0].incarnation.startswith(f"{second}-")


def test_a_backup_is_given_up_once_a_later_incarnation_restores_an_older_step_which_the_job_writes_again():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [3, 5], 1.0, replicated=[3])  # step 5 is not replicated yet
    state.tick(2.0)
    assert state.job(KEY).backup_pending == 5
    # Node b is lost before step 5 was replicated: the fresh node c restores step 3, and the job will write 5 again.
    lost_rank = rank_of["b"]
    state.expire(100.0)
    second, rank_of = form(state, ("a", "c"), ("uid2", "uid3"), 100.0)
    held_a = [own(3, rank_of["a"]), own(5, rank_of["a"]), replica(3, lost_rank)]
    heartbeat(state, "a", 0, "uid2", second, rank_of["a"], held_a, 101.0)
    heartbeat(state, "c", 1, "uid3", second, lost_rank, [], 101.0)
    lister = state.job(KEY).lister  # lists no backup yet
    state.apply_report(
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, (), 101.0),)), 101.0
    )
    assert state.restore.view(KEY, second, lost_rank, now=101.5).step == 3
    state.tick(102.0)
    assert state.job(KEY).backup_pending != 5
    orders = heartbeat(state, "a", 0, "uid2", second, rank_of["a"], held_a, 103.0).backup
    assert all(o.step != 5 for o in orders)


def test_the_backup_lag_is_exported_in_steps_and_seconds_and_falls_to_zero_once_backed_up():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    for now, step in ((1.0, 5), (31.0, 9)):
        saved_everywhere(state, first, rank_of, [step], now)
        state.tick(now + 1.0)
    assert state.safe_step(KEY) == 9
    text = exposition(state).decode()
    labels = '{training_job="run",training_namespace="default"}'
    assert f"mtc_backup_lag_steps{labels} 9.0" in text
    assert f"mtc_backup_lag_seconds{labels} 31.0" in text  # step 5 was first safe at 2 s; the clock is at 33 s
    lister = state.job(KEY).lister
    state.apply_report(
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, ((9, 0),), 40.0),)),
        40.0,
    )
    state.tick(41.0)
    text = exposition(state).decode()
    assert f"mtc_backup_lag_steps{labels} 0.0" in text and f"mtc_backup_lag_seconds{labels} 0.0" in text


def test_a_backup_listed_last_by_a_node_since_lost_is_still_known_to_the_next_incarnation():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [5], 1.0)
    # The lister (a) listed before the backup of step 5; b wrote its COMMIT and listed it at once.
    for node, steps, at in (("a", (), 1.0), ("b", ((5, 0),), 4.0)):
        state.apply_report(
            msgspec.structs.replace(state.liveness.nodes[node].report, backed_up=(BackedUp(*NAMES, steps, at),)), at
        )
    state.tick(5.0)
    assert state.backed_up(KEY) == {5}
    # b is lost; the next incarnation runs on a and c. Until a lists again, b's listing is the newest there is.
    state.expire(30.0)  # silent past the node timeout, within the grace
    form(state, ("a", "c"), ("uid2", "uid3"), 30.0)
    state.tick(31.0)
    assert state.backed_up(KEY) == {5}


def test_the_safe_steps_remembered_for_the_lag_stay_few_through_a_long_store_outage_and_overstate_it():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    for step in range(1, 201):  # no backup completes: 200 steps become safe, one a second
        saved_everywhere(state, first, rank_of, [step], float(step))
        state.tick(float(step) + 0.5)
    job = state.job(KEY)._job
    assert len(job.safe_at) <= 64 and min(job.safe_at.values()) == 1.0  # step 1, safe at its second report
    lister = state.job(KEY).lister
    state.apply_report(
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, ((100, 0),), 300.0),)),
        300.0,
    )
    state.tick(301.0)
    steps, seconds = state.backup_lag(KEY, state.backed_up(KEY))
    assert steps == 100 and seconds >= 301.0 - 101.0  # step 101 was first safe at 101 s: overstated, never under


def test_backup_interval_minutes_counts_from_when_the_last_backup_was_chosen_not_from_when_it_completed():
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0, JobSettings((), 1, 1.0, None))
    saved_everywhere(state, first, rank_of, [5], 1.0)  # step 5 is safe at 1 s: chosen then
    assert state.job(KEY).backup_pending == 5
    lister = state.job(KEY).lister
    state.apply_report(  # its upload took 48 s: listed complete at 50 s
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, ((5, 0),), 50.0),)),
        50.0,
    )
    state.tick(50.0)
    assert state.job(KEY).backup_pending is None
    saved_everywhere(state, first, rank_of, [5, 9], 55.0)
    saved_everywhere(state, first, rank_of, [5, 9], 60.5)
    state.tick(60.5)
    assert state.job(KEY).backup_pending is None  # 59.5 s after the last choice
    saved_everywhere(state, first, rank_of, [5, 9], 66.0)
    state.tick(66.0)
    # One minute after step 5 was chosen, not one minute after it completed (at 110 s): the upload's 48 s would have
    # been added to every interval, and to the lag a cluster loss costs.
    assert state.job(KEY).backup_pending == 9


def test_a_coordinator_restarted_mid_backup_orders_the_same_step_under_the_same_tag_and_keeps_the_lag(tmp_path):
    """Issue 49: the coordinator is SIGKILLed while step 5 is backed up, a newer step 9 safe meanwhile. Restarted on
    its state dir, it orders step 5 again under the same upload tag (what was uploaded counts toward its COMMIT;
    choosing anew would upload every rank again), and the lag still counts from when step 5 was first safe."""
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [5], 1.0)
    state.tick(2.0)
    (tag,) = {o.incarnation for o in saved_everywhere(state, first, rank_of, [5], 3.0)}
    saved_everywhere(state, first, rank_of, [5, 9], 31.0)
    state.tick(32.0)
    assert (state.job(KEY).backup_pending, state.safe_step(KEY)) == (5, 9)
    kept = RecoverySnapshot(str(tmp_path))
    kept.write(kept.collect(state, 0.0))

    restarted = ClusterState()
    restarted.expire(40.0)
    for rank in (0, 1):
        restarted.restore.settings_from_snapshot(KEY, rank, SETTINGS)  # the settings snapshot
    RecoverySnapshot(str(tmp_path)).load(restarted)
    saved_everywhere(restarted, first, rank_of, [5, 9], 41.0)  # the pods still report the incarnation: adopted
    restarted.tick(42.0)
    assert restarted.job(KEY).backup_pending == 5
    orders = saved_everywhere(restarted, first, rank_of, [5, 9], 43.0)
    assert sorted((o.step, o.rank, o.incarnation) for o in orders) == [(5, 0, tag), (5, 1, tag)]
    labels = '{training_job="run",training_namespace="default"}'
    assert f"mtc_backup_lag_seconds{labels} 42.0" in exposition(restarted).decode()  # step 5 first safe at 1 s


def test_the_next_backup_is_chosen_in_the_pass_that_finds_the_previous_one_complete():
    """Issue 49: a pass later, the next backup started a heartbeat late, and the lag a cluster loss leaves grew by it
    once per backup (interval 1 step here: step 9 is due as soon as step 5 is backed up)."""
    state = ClusterState()
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [5], 1.0)
    state.tick(2.0)
    assert state.job(KEY).backup_pending == 5
    saved_everywhere(state, first, rank_of, [5, 9], 10.0)
    state.tick(10.5)
    assert state.job(KEY).backup_pending == 5  # still uploading: one backup at a time
    lister = state.job(KEY).lister
    state.apply_report(
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, ((5, 0),), 20.0),)),
        20.0,
    )
    assert state.backed_up(KEY) == {5} and state.job(KEY).backup_pending == 9


def lost_mid_backup(state):
    """Nodes a and b back up step 5 and save step 8; b is lost mid-backup and a fresh node c restores step 8 in its
    place. Node a holds rank b's replicas of both. Returns (the incarnation, node -> rank, a's steps, 5's tag)."""
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0)
    saved_everywhere(state, first, rank_of, [5], 1.0)  # each holds its own step 5 and the other's replica
    state.tick(2.0)
    assert state.job(KEY).backup_pending == 5
    (tag,) = {o.incarnation for o in saved_everywhere(state, first, rank_of, [5, 8], 3.0)}
    state.tick(4.0)
    lost_rank, kept_rank = rank_of["b"], rank_of["a"]
    held_a = [own(5, kept_rank), own(8, kept_rank), replica(5, lost_rank), replica(8, lost_rank)]
    state.expire(100.0)
    second, rank_of = form(state, ("a", "c"), ("uid2", "uid3"), 100.0, held={"a": held_a})
    assert rank_of["c"] == lost_rank
    heartbeat(state, "a", 0, "uid2", second, kept_rank, held_a, 101.0)
    heartbeat(state, "c", 1, "uid3", second, lost_rank, [own(8, lost_rank)], 101.0)
    state.tick(102.0)
    return second, rank_of, held_a, tag


def test_a_rank_whose_node_was_lost_mid_backup_is_uploaded_from_its_replica_and_the_backup_is_kept():
    state = ClusterState()
    second, rank_of, held_a, tag = lost_mid_backup(state)
    lost_rank, kept_rank = rank_of["c"], rank_of["a"]
    # Step 5 is not given up for 8: node a uploads both ranks of it, under the tag the lost node uploaded with.
    assert state.job(KEY).backup_pending == 5 and dict(state.job(KEY).backup_stand_ins) == {lost_rank: StandIn("a")}
    orders = heartbeat(state, "a", 0, "uid2", second, kept_rank, held_a, 103.0).backup
    assert sorted((o.step, o.rank, o.incarnation) for o in orders) == sorted([(5, kept_rank, tag), (5, lost_rank, tag)])
    assert heartbeat(state, "c", 1, "uid3", second, lost_rank, [own(8, lost_rank)], 103.0).backup == ()

    # Once listed complete, the next backup (step 8) is chosen in the same pass, with no stand-in left.
    lister = state.job(KEY).lister
    state.apply_report(
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, ((5, 0),), 104.0),)),
        104.0,
    )
    state.tick(105.0)
    assert state.job(KEY).backup_pending == 8 and dict(state.job(KEY).backup_stand_ins) == {}
    orders = heartbeat(state, "c", 1, "uid3", second, lost_rank, [own(8, lost_rank)], 106.0).backup
    assert [(o.step, o.rank) for o in orders] == [(8, lost_rank)]


def test_a_stranded_rank_whose_replica_goes_too_gives_the_backup_up_at_once_for_a_newer_complete_step():
    state = ClusterState()
    second, rank_of, held_a, _ = lost_mid_backup(state)
    lost_rank, kept_rank = rank_of["c"], rank_of["a"]
    assert state.job(KEY).backup_pending == 5
    # Node a drops its replica of rank c's step 5 (space pressure): no node can upload it any more.
    heartbeat(
        state, "a", 0, "uid2", second, kept_rank, [h for h in held_a if (h.step, h.rank) != (5, lost_rank)], 107.0
    )
    state.tick(108.0)
    assert state.job(KEY).backup_pending == 8 and dict(state.job(KEY).backup_stand_ins) == {}


# Data parallelism 2 without replicas: ranks 0 and 1 are each other's peer, and both write these bytes.
DP_SETTINGS = {0: JobSettings((1,), 2, None, 1), 1: JobSettings((0,), 2, None, 1)}
DP_FILES = {"model/shard": (10, "0000000d")}


def dp_own(step, rank, files=DP_FILES):
    return HeldStep(*NAMES, step, rank, files, signature="the step's structure")


def dp_lost_mid_backup(state, lost_files=DP_FILES, peer_files=DP_FILES):
    """A DP2 job on nodes a and b, no replicas, backs up step 5 and saves step 8 (their steps 5: node b's
    ``lost_files``, node a's ``peer_files``, with the same structure's signature); b is lost mid-backup and a fresh
    node c restores step 8 in its place. Returns (the incarnation, node -> rank, a's steps, 5's tag)."""
    state.expire(0.0)
    first, rank_of = form(state, ("a", "b"), ("uid0", "uid1"), 0.0, settings=DP_SETTINGS)
    kept, lost = rank_of["a"], rank_of["b"]
    for now, steps in ((1.0, [5]), (3.0, [5, 8])):
        for index, node, files in ((0, "a", peer_files), (1, "b", lost_files)):
            held = [dp_own(s, rank_of[node], files if s == 5 else DP_FILES) for s in steps]
            reply = heartbeat(state, node, index, f"uid{index}", first, rank_of[node], held, now)
        state.tick(now + 1)
    assert state.job(KEY).backup_pending == 5 and (lost, kept) in state.identical(KEY)[5]
    (tag,) = {o.incarnation for o in reply.backup}
    held_a = [dp_own(5, kept, peer_files), dp_own(8, kept)]
    state.expire(100.0)
    second, rank_of = form(state, ("a", "c"), ("uid2", "uid3"), 100.0, settings=DP_SETTINGS, held={"a": held_a})
    assert rank_of["c"] == lost
    heartbeat(state, "a", 0, "uid2", second, kept, held_a, 101.0)
    heartbeat(state, "c", 1, "uid3", second, lost, [dp_own(8, lost)], 101.0)
    state.tick(102.0)
    return second, rank_of, held_a, tag


@pytest.mark.parametrize("shared", [False, True])
def test_a_stranded_rank_of_a_data_parallel_job_without_replicas_is_referenced_by_its_identical_peer(shared):
    """Issue 49: the lost rank's data-parallel peer, found identical at step 5 and holding it in the lost rank's
    checksums, writes the lost rank's manifest naming its own upload; its own upload no longer waits for the lost
    rank (its leader, or a member of its shared upload, at step 5)."""
    state = ClusterState(shared_backup=shared)
    second, rank_of, held_a, tag = dp_lost_mid_backup(state)
    lost, kept = rank_of["c"], rank_of["a"]
    assert state.job(KEY).backup_pending == 5 and dict(state.job(KEY).backup_stand_ins) == {lost: StandIn("a", kept)}
    orders = heartbeat(state, "a", 0, "uid2", second, kept, held_a, 103.0).backup
    mine, stand_in = sorted(orders, key=lambda o: o.rank != kept)
    assert (mine.step, mine.rank, mine.incarnation, mine.data_rank) == (5, kept, tag, None)
    assert (mine.dedup_from_rank, mine.share_group) == (None, ())  # uploads alone: the lost rank uploads nothing
    assert (stand_in.step, stand_in.rank, stand_in.incarnation) == (5, lost, tag)
    assert (stand_in.data_rank, stand_in.dedup_from_rank, stand_in.share_group) == (kept, kept, ())
    assert stand_in.data_digest == files_digest(DP_FILES)  # the lost rank's checksums, as its own node reported them
    assert heartbeat(state, "c", 1, "uid3", second, lost, [dp_own(8, lost)], 103.0).backup == ()


@pytest.mark.parametrize(
    "lost_files, peer_files",
    [
        ({"model/shard": (10, "0000000e")}, DP_FILES),  # the same structure (signature), other bytes
        ({"model/shard": (10, CRC32C_RESIDUE)}, {"model/shard": (10, CRC32C_RESIDUE)}),  # CRC32Cs that prove nothing
    ],
)
def test_a_data_parallel_peer_not_proven_to_hold_the_stranded_ranks_bytes_does_not_stand_in(lost_files, peer_files):
    """Found identical by the index (equal signatures) is not enough: the backup of a rank must be the bytes it wrote.
    With no other way to upload the lost rank, the backup is given up at once for the newer complete step."""
    state = ClusterState()
    dp_lost_mid_backup(state, lost_files, peer_files)
    assert state.job(KEY).backup_pending == 8 and dict(state.job(KEY).backup_stand_ins) == {}


def test_a_replica_of_the_stranded_rank_is_preferred_to_a_data_parallel_peers_copy():
    state = ClusterState()
    second, rank_of, held_a, _ = dp_lost_mid_backup(state)
    lost, kept = rank_of["c"], rank_of["a"]
    held_a = [*held_a, HeldStep(*NAMES, 5, lost, DP_FILES, replica=True)]
    heartbeat(state, "a", 0, "uid2", second, kept, held_a, 103.0)
    state.tick(104.0)
    assert dict(state.job(KEY).backup_stand_ins) == {lost: StandIn("a")}
    orders = heartbeat(state, "a", 0, "uid2", second, kept, held_a, 105.0).backup
    assert sorted((o.rank, o.data_rank, o.data_digest) for o in orders) == sorted(
        [(kept, None, None), (lost, None, None)]
    )


def test_a_coordinator_restarted_mid_backup_keeps_the_evidence_for_a_data_parallel_stand_in(tmp_path):
    """The lost rank's node never reports its checksums and signature of step 5 again: the state dir keeps them, so a
    restarted coordinator still lets the peer stand in (without them it gave the backup up)."""
    state = ClusterState()
    second, rank_of, held_a, tag = dp_lost_mid_backup(state)
    lost, kept = rank_of["c"], rank_of["a"]
    kept_dir = RecoverySnapshot(str(tmp_path))
    kept_dir.write(kept_dir.collect(state, 0.0))

    restarted = ClusterState()
    restarted.expire(110.0)
    for rank, settings in DP_SETTINGS.items():
        restarted.restore.settings_from_snapshot(KEY, rank, settings)
    RecoverySnapshot(str(tmp_path)).load(restarted)
    for now in (111.0, 113.0):
        heartbeat(restarted, "a", 0, "uid2", second, kept, held_a, now)
        heartbeat(restarted, "c", 1, "uid3", second, lost, [dp_own(8, lost)], now)
        restarted.tick(now + 1)
    assert restarted.job(KEY).backup_pending == 5
    assert dict(restarted.job(KEY).backup_stand_ins) == {lost: StandIn("a", kept)}
    orders = heartbeat(restarted, "a", 0, "uid2", second, kept, held_a, 115.0).backup
    assert sorted((o.rank, o.incarnation, o.data_rank, o.data_digest) for o in orders) == sorted(
        [(kept, tag, None, None), (lost, tag, kept, files_digest(DP_FILES))]
    )
