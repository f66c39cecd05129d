"""The coordinator's state machine as pure functions of reports and time, at 10,000 nodes: stable
assignments, orders exactly when due, no recomputation when nothing changed, identity decided once."""

import msgspec
import pytest

from replicator.coordinator.indices.identical_ranks import Identity, LeaderMemo
from replicator.coordinator.state import (
    PEER_SOURCES_PER_VIEW,
    ClusterState,
    NotReady,
    UnknownIncarnation,
    decide_interval,
)
from replicator.wire.messages import BackedUp, HeldStep, JobRef, JobSettings, NodeReport, PodReport
from tests.helpers.reports import node_report, pod_report

NODES = 10_000
SLICES = 40
KEY = JobRef("default", "big")
NAMES = (KEY.namespace, KEY.job)  # a message's namespace and job fields
STEP_FILES = {
    "_CHECKPOINT_METADATA": (10, "00000001"),
    "state/_METADATA": (20, "00000002"),
    "state/d/a": (30, "00000003"),
}


def pod(node: int, nodes: int, slices: int, incarnation=None, rank=None, settings=None) -> PodReport:
    slice_index, worker = divmod(node, nodes // slices)
    return pod_report(KEY, slice_index, worker, f"uid-{node}", incarnation, rank, settings, nodes=nodes, slices=slices)


def report(node: int, pods=(), held=(), has_backup=False) -> NodeReport:
    return node_report(f"n{node}", pods, held, topology={"block": f"b{node // 250}"}, has_backup=has_backup)


def own(step: int, rank: int, files=STEP_FILES, signature=None) -> HeldStep:
    return HeldStep(*NAMES, step, rank, files, signature=signature or f"sig-{step}")


def form_job(state: ClusterState, nodes: int, slices: int, settings: JobSettings, now: float) -> dict[int, int]:
    """Every node publishes its pod; returns node -> rank once the incarnation exists."""
    for node in range(nodes):
        state.apply_report(report(node, [pod(node, nodes, slices)]), now)
    state.tick(now + decide_interval(nodes))
    incarnation = state.job(KEY).incarnation
    assert incarnation is not None
    rank_of = {int(node[1:]): rank for rank, node in incarnation.node_of_rank.items()}
    for rank in rank_of.values():
        state.restore.settings(KEY, incarnation.incarnation_id, rank, settings)
    return rank_of


def heartbeat_round(state, nodes, rank_of, held, now, with_files=False):
    incarnation = state.job(KEY).incarnation.incarnation_id
    settings = next(iter(state.job(KEY).settings.values()))
    replies = {}
    for node in range(nodes):
        rank = rank_of[node]
        steps = tuple(
            held(rank)
            if with_files
            else (h.__class__(*NAMES, h.step, h.rank, None, h.replica, h.signature) for h in held(rank))
        )
        replies[node] = state.apply_report(
            report(node, [pod(node, nodes, SLICES, incarnation, rank, settings)], steps), now
        )
    return replies


def test_assignments_follow_the_jobset_order_and_stay_stable_across_heartbeats():
    state = ClusterState()
    state.expire(0.0)
    rank_of = form_job(state, NODES, SLICES, JobSettings((), 1, None, 100), now=0.0)
    # With no data anywhere, a pod's rank is its JobSet position: slice * per-slice + worker.
    assert rank_of == {node: node for node in range(NODES)}
    first = heartbeat_round(state, NODES, rank_of, lambda rank: [own(10, rank)], 1.0, with_files=True)
    again = heartbeat_round(state, NODES, rank_of, lambda rank: [own(10, rank)], 2.0)
    assert [r.assignments for r in first.values()] == [r.assignments for r in again.values()]
    assert all(r.assignments[0].rank == node for node, r in again.items())
    assert state.operator.status().nodes[:2] == ("n0", "n1") and len(state.operator.status().nodes) == NODES


def test_unchanged_heartbeats_recompute_nothing():
    state = ClusterState()
    state.expire(0.0)
    rank_of = form_job(state, NODES, SLICES, JobSettings((), 1, None, 100), now=0.0)
    heartbeat_round(state, NODES, rank_of, lambda rank: [own(10, rank)], 1.0, with_files=True)
    state.tick(3.0)
    before = state.decisions
    for now in (3.5, 4.0, 4.5):  # within the 5 s recheck: only unchanged heartbeats
        replies = heartbeat_round(state, NODES, rank_of, lambda rank: [own(10, rank)], now)
        state.tick(now)
    assert state.decisions == before
    assert not any(r.want_files for r in replies.values())
    # One changed report (a new step) makes the job dirty: exactly one pass once it is due.
    state.apply_report(
        report(7, [pod(7, NODES, SLICES, state.job(KEY).incarnation.incarnation_id, 7)], [own(10, 7), own(20, 7)]), 4.6
    )
    state.tick(4.6 + decide_interval(NODES))
    assert state.decisions == before + 1


def test_replicate_and_backup_orders_are_issued_exactly_when_due():
    state = ClusterState()
    state.expire(0.0)
    nodes = 8
    rank_of = form_job(state, nodes, 2, JobSettings((), 1, None, 2), now=0.0)  # replicas=1, back up every 2 steps

    def held(node, steps, replicas=()):
        rank = rank_of[node]
        return [own(s, rank) for s in steps] + [HeldStep(*NAMES, s, r, None, replica=True) for s, r in replicas]

    incarnation = state.job(KEY).incarnation
    targets = state.job(KEY).replica_targets
    # Step 4 is every rank's round once every rank holds it (replicas.choose_round), not before.
    reply = state.apply_report(report(0, [pod(0, nodes, 2, incarnation.incarnation_id, rank_of[0])], held(0, [4])), 1.0)
    assert reply.replicate == ()
    for node in range(1, nodes):
        state.apply_report(
            report(node, [pod(node, nodes, 2, incarnation.incarnation_id, rank_of[node])], held(node, [4])), 1.0
        )
    state.tick(1.0 + decide_interval(nodes))
    reply = state.apply_report(report(0, [pod(0, nodes, 2, incarnation.incarnation_id, rank_of[0])], held(0, [4])), 1.0)
    assert [(o.step, [t.node for t in o.targets]) for o in reply.replicate] == [(4, targets[rank_of[0]])]
    # Once the target holds the replica, no order any more.
    target = int(targets[rank_of[0]][0][1:])
    state.apply_report(
        report(
            target,
            [pod(target, nodes, 2, incarnation.incarnation_id, rank_of[target])],
            held(target, [], [(4, rank_of[0])]),
        ),
        1.1,
    )
    reply = state.apply_report(report(0, [pod(0, nodes, 2, incarnation.incarnation_id, rank_of[0])], held(0, [4])), 1.2)
    assert reply.replicate == ()
    # No backup while no node has a backup tier: a step chosen then would only be kept from GC.
    for node in range(nodes):
        reply = state.apply_report(
            report(node, [pod(node, nodes, 2, incarnation.incarnation_id, rank_of[node])], held(node, [4])), 1.3
        )
        assert reply.backup == ()
    state.tick(1.3 + decide_interval(nodes))
    assert state.job(KEY).backup_pending is None
    # With backup tiers: no backup before every rank holds the step; then one order per rank, for its own node only.
    for node in range(nodes):
        reply = state.apply_report(
            report(
                node, [pod(node, nodes, 2, incarnation.incarnation_id, rank_of[node])], held(node, [6]), has_backup=True
            ),
            1.4,
        )
        assert [(o.step, o.rank) for o in reply.backup] == ([(6, rank_of[node])] if node == nodes - 1 else [])
    assert state.job(KEY).backup_pending == 6


def test_data_parallel_identity_is_decided_once_per_step_and_pair():
    state = ClusterState()
    state.expire(0.0)
    nodes, half = NODES, NODES // 2
    settings = {rank: JobSettings(((rank + half) % nodes,), 2, None, 100) for rank in range(nodes)}
    for node in range(nodes):
        state.apply_report(report(node, [pod(node, nodes, SLICES)]), 0.0)
    state.tick(decide_interval(nodes))
    incarnation = state.job(KEY).incarnation
    rank_of = {int(node[1:]): rank for rank, node in incarnation.node_of_rank.items()}
    for rank in rank_of.values():
        state.restore.settings(KEY, incarnation.incarnation_id, rank, settings[rank])
    for now in (1.0, 2.0, 3.0):  # the same step reported three times
        heartbeat_round(state, nodes, rank_of, lambda rank: [own(10, rank)], now, with_files=now == 1.0)
        state.tick(now + decide_interval(nodes))
    assert state.identity_checks == nodes // 2  # each pair of peers compared once
    assert state.identical(KEY)[10] == frozenset((r, (r + half) % nodes) for r in range(nodes))
    assert state.safe_step(KEY) == 10


def test_every_rank_restarting_at_once_costs_a_few_decision_passes_not_one_per_rank():
    state = ClusterState()
    state.expire(0.0)
    nodes, half = NODES, NODES // 2
    settings = {rank: JobSettings(((rank + half) % nodes,), 2, None, 100) for rank in range(nodes)}
    rank_of = form_job(state, nodes, SLICES, JobSettings((), 2, None, 100), now=0.0)
    heartbeat_round(state, nodes, rank_of, lambda rank: [own(10, rank)], 1.0, with_files=True)
    for node in range(nodes):  # the nodes have a backup tier that nobody listed yet: restores wait for it
        state.apply_report(msgspec.structs.replace(state.liveness.nodes[f"n{node}"].report, has_backup=True), 39.0)
    state.tick(39.0 + decide_interval(nodes))
    decisions, incarnation = state.decisions, state.job(KEY).incarnation.incarnation_id

    state.expire(40.0)  # past the fresh-coordinator wait: each rank records its settings and asks, in turn
    for rank in range(nodes):
        state.restore.settings(KEY, incarnation, rank, settings[rank])
        with pytest.raises(NotReady):
            state.restore.view(KEY, incarnation, rank, 40.0)
    assert state.decisions - decisions <= 2  # not one decision pass per rank
    lister = state.job(KEY).lister
    state.apply_report(
        msgspec.structs.replace(state.liveness.nodes[lister].report, backed_up=(BackedUp(*NAMES, (), 41.0),)), 41.0
    )
    state.tick(41.0 + decide_interval(nodes))
    assert {state.restore.view(KEY, incarnation, rank, 42.0).step for rank in range(nodes)} == {10}
    assert state.identical(KEY)[10] == frozenset((r, (r + half) % nodes) for r in range(nodes))


def test_a_job_forms_when_its_last_pod_reports_not_at_its_next_paced_pass():
    state = ClusterState()
    state.expire(0.0)
    for node in range(NODES):  # every pod of a new job within 0.1 s: its passes are paced a second apart
        state.apply_report(report(node, [pod(node, NODES, SLICES)]), node * 1e-5)
    first = state.job(KEY).incarnation
    assert first is not None  # formed by the last pod's report, no tick needed: every long poll waits on it
    decisions = state.decisions
    for node in range(NODES):  # a job restart: a new pod on every node, again within 0.1 s
        new_pod = msgspec.structs.replace(pod(node, NODES, SLICES), pod_uid=f"new-{node}")
        state.apply_report(report(node, [new_pod]), 10.0 + node * 1e-5)
    second = state.job(KEY).incarnation
    assert second is not None and second.incarnation_id != first.incarnation_id
    assert set(second.rank_of_pod) == {f"new-{node}" for node in range(NODES)}
    assert state.decisions - decisions <= 3  # the one that ended the old incarnation, the one that formed the new


def test_a_restarted_coordinator_asks_once_for_the_checksums_it_lacks():
    state = ClusterState()
    state.expire(0.0)
    rank_of = form_job(state, 4, 1, JobSettings((), 1, None, 100), now=0.0)
    fresh = ClusterState()
    incarnation = state.job(KEY).incarnation.incarnation_id
    settings = JobSettings((), 1, None, 100)
    bare = lambda node: [HeldStep(*NAMES, 10, rank_of[node], None, signature="s")]  # noqa: E731
    replies = [
        fresh.apply_report(report(n, [pod(n, 4, 1, incarnation, rank_of[n], settings)], bare(n)), 50.0)
        for n in range(4)
    ]
    assert all(r.want_files for r in replies)
    replies = [
        fresh.apply_report(report(n, [pod(n, 4, 1, incarnation, rank_of[n], settings)], [own(10, rank_of[n])]), 51.0)
        for n in range(4)
    ]
    assert not any(r.want_files for r in replies)
    assert fresh.job(KEY).incarnation.incarnation_id == incarnation  # adopted, not reassigned
    assert fresh.job(KEY).owner_files(10, 0) == STEP_FILES
    assert not any(
        fresh.apply_report(report(n, [pod(n, 4, 1, incarnation, rank_of[n], settings)], bare(n)), 52.0).want_files
        for n in range(4)
    )


@pytest.mark.parametrize(
    ("live", "heartbeat", "timeout"), [(4, 1.0, 15.0), (1_000, 1.0, 15.0), (4_000, 4.0, 15.0), (10_000, 10.0, 30.0)]
)
def test_heartbeats_slow_down_as_the_cluster_grows_and_the_timeout_follows(live, heartbeat, timeout):
    state = ClusterState(node_timeout_seconds=15.0)
    for node in range(live):
        state.apply_report(report(node), 0.0)
    assert state.heartbeat_seconds == heartbeat and state.liveness.node_timeout_seconds == timeout


def form_job_of_40_slices(state: ClusterState) -> tuple[dict[int, int], str]:
    """A NODES-rank job of SLICES slices whose every rank recorded its 39 data-parallel peers (the
    same worker in every other slice). Returns (node -> rank, incarnation id)."""
    state.expire(0.0)
    per_slice = NODES // SLICES
    rank_of = form_job(state, NODES, SLICES, JobSettings((), SLICES, None, 100), now=0.0)
    incarnation = state.job(KEY).incarnation.incarnation_id
    for rank in range(NODES):
        peers = tuple(p for p in range(rank % per_slice, NODES, per_slice) if p != rank)
        state.restore.settings(KEY, incarnation, rank, JobSettings(peers, SLICES, None, 100))
    return rank_of, incarnation


def test_a_restore_of_a_40_slice_job_lists_each_rank_a_few_of_its_39_identical_peers():
    state = ClusterState()
    rank_of, incarnation = form_job_of_40_slices(state)
    heartbeat_round(state, NODES, rank_of, lambda rank: [own(10, rank)], 1.0, with_files=True)
    state.tick(1.0 + decide_interval(NODES))
    assert len(state.identical(KEY)[10]) == NODES * (SLICES - 1)
    views = [state.restore.view(KEY, incarnation, rank, 40.0) for rank in range(NODES)]
    assert {v.step for v in views} == {10}
    assert all(
        v.sources[0].tier == "local" and v.sources[0].holder == f"n{rank}" for rank, v in zip(range(NODES), views)
    )
    # A few of the 39 identical peers (with the step's checksums each), not all of them.
    assert {len(v.sources) for v in views} == {1 + PEER_SOURCES_PER_VIEW}
    assert max(len(msgspec.json.encode(v)) for v in views) < 2_000


def test_signatures_arriving_over_many_passes_are_each_compared_once_per_peer():
    state = ClusterState()
    per_slice = NODES // SLICES
    rank_of, _ = form_job_of_40_slices(state)
    state.tick(decide_interval(NODES))

    def held(rank, now):  # the ranks save step 10 staggered over five passes; slice 0's data differs
        return [own(10, rank, signature="sig-slice-0" if rank < per_slice else None)] if rank % 5 < now else []

    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        heartbeat_round(state, NODES, rank_of, lambda rank: held(rank, now), now, with_files=True)
        state.tick(now + decide_interval(NODES))
    assert state.identity_checks == NODES * (SLICES - 1) // 2  # every pair once, identical or not
    assert len(state.identical(KEY)[10]) == (NODES - per_slice) * (SLICES - 2)


def test_backup_groups_are_kept_while_identities_of_newer_steps_are_found():
    identity, leaders = Identity(), LeaderMemo()
    identity.add_peers(0, JobSettings((1,), 2, None, 100))
    for rank in (0, 1):
        identity.add_signature(100, rank, "step-100")
    identity.compare()
    assert leaders.group(identity, 100, 0) == (0, 1)
    kept = leaders.groups
    for rank in (0, 1):  # the next step's identities, found while step 100 is backed up
        identity.add_signature(200, rank, "step-200")
    identity.compare()
    assert leaders.group(identity, 100, 1) == (0, 1)
    assert leaders.groups is kept  # not walked again for each report
    identity.supersede(100, 1)  # step 100's own identity changed: the groups are found again
    assert leaders.group(identity, 100, 0) == (0,)
    assert leaders.groups is not kept


def test_a_decision_pass_looks_rank_by_rank_only_at_steps_every_rank_holds():
    state = ClusterState()
    rank_of, _ = form_job_of_40_slices(state)
    newest = lambda rank: [own(20, rank)] if rank % 2 else []  # noqa: E731 - step 20 half saved
    heartbeat_round(state, NODES, rank_of, lambda rank: [own(10, rank), *newest(rank)], 1.0, with_files=True)
    state.tick(1.0 + decide_interval(NODES))
    assert state.safe_step(KEY) == 10 and state.newest_complete_step(KEY) == 10
    checks = state.rank_checks
    heartbeat_round(
        state,
        NODES,
        rank_of,
        lambda rank: [own(10, rank), *newest(rank), own(30, rank)] if rank == 1 else [own(10, rank), *newest(rank)],
        3.0,
    )
    state.tick(3.0 + decide_interval(NODES))
    # Steps 30 and 20 are skipped on their rank counts; step 10 is walked once for safety and once
    # for the backup choice: never one walk per step held.
    assert state.rank_checks - checks <= 2 * NODES
    # The per-step rank counts follow the claims as copies come and go.
    heartbeat_round(state, NODES, rank_of, newest, 5.0)
    state.tick(5.0 + decide_interval(NODES))
    job = state.job(KEY)
    recount: dict[int, int] = {}
    for step, _ in job.claimed():
        recount[step] = recount.get(step, 0) + 1
    assert job.ranks_claimed() == recount == {20: NODES // 2}
    assert state.safe_step(KEY) is None


def test_a_silent_node_asking_for_its_restore_is_live_again():
    state = ClusterState(node_timeout_seconds=15.0)
    state.expire(0.0)
    rank_of = form_job(state, 4, 1, JobSettings((), 1, None, 100), now=0.0)
    incarnation = state.job(KEY).incarnation.incarnation_id
    for node in range(1, 4):
        state.apply_report(report(node, [pod(node, 4, 1, incarnation, rank_of[node])]), 20.0)
    state.expire(20.0)
    state.tick(20.0)
    assert not state.is_live("n0") and not state.job(KEY).undecided
    state.restore.touch_rank(KEY, incarnation, rank_of[0], 21.0)  # its restore long poll, the agent's only connection
    assert state.is_live("n0") and state.job(KEY).undecided  # its copies count again: the job is decided again
    state.expire(22.0)
    assert state.operator.status().silent_nodes == ()
    with pytest.raises(UnknownIncarnation):
        state.restore.touch_rank(KEY, "another", 0, 22.0)


def test_nodes_falling_silent_do_not_shorten_the_timeout_of_the_others():
    state = ClusterState(node_timeout_seconds=15.0)
    for node in range(NODES):
        state.apply_report(report(node), 0.0)
    assert state.heartbeat_seconds == 10.0 and state.liveness.node_timeout_seconds == 30.0
    for node in range(2_000):  # the others lag (a loaded network or agents): silent at 31 s
        state.apply_report(report(node), 25.0)
    state.expire(31.0)
    assert len(state.operator.status().silent_nodes) == NODES - 2_000
    # The agents that reported at 25 s were told 10 s heartbeats: the timeout stays three of them.
    assert state.liveness.node_timeout_seconds == 30.0
    state.expire(50.0)
    assert "n1" in state.operator.status().nodes


def test_the_silence_check_finds_silent_nodes_however_recently_the_others_reported():
    state = ClusterState(node_timeout_seconds=15.0)
    for node in range(4):
        state.apply_report(report(node), float(node))
    state.apply_report(report(0), 10.0)  # heard from again: no longer the oldest
    state.expire(19.0)
    assert [n for n in ("n0", "n1", "n2", "n3") if state.liveness.nodes[n].silent] == ["n1", "n2", "n3"]
    assert state.liveness.live_count() == 1  # mtc_live_nodes
    state.apply_report(report(2), 20.0)  # back from silence
    state.expire(26.0)
    assert [n for n in ("n0", "n1", "n2", "n3") if state.liveness.nodes[n].silent] == ["n0", "n1", "n3"]
    assert state.liveness.live_count() == 1
    state.apply_report(report(1), 27.0)
    assert state.liveness.live_count() == 2


def test_a_complete_step_is_walked_once_until_a_holder_falls_silent():
    state = ClusterState(node_timeout_seconds=15.0)
    state.expire(0.0)
    rank_of = form_job(state, 4, 2, JobSettings((), 1, None, 100), now=0.0)
    incarnation = state.job(KEY).incarnation.incarnation_id
    for rank in range(4):  # ranks r and r + 2 are data-parallel peers
        state.restore.settings(KEY, incarnation, rank, JobSettings(((rank + 2) % 4,), 2, None, 100))

    def heartbeat(nodes, now):
        for node in nodes:
            rank = rank_of[node]
            settings = state.job(KEY).settings[rank]
            state.apply_report(
                report(
                    node, [pod(node, 4, 2, incarnation, rank, settings)], [own(10, rank, signature=f"sig-{rank % 2}")]
                ),
                now,
            )

    heartbeat(range(4), 1.0)
    state.tick(2.0)
    assert state.safe_step(KEY) == 10
    checks = state.rank_checks
    state.tick(8.0)  # the 5 s recheck: a pass, but the step's answer stands
    assert state.safe_step(KEY) == 10 and state.rank_checks == checks
    heartbeat([n for n in range(4) if rank_of[n] != 0], 10.0)
    state.tick(20.0)  # rank 0's only copy is on a node silent past the timeout: nothing is safe
    assert state.liveness.nodes[f"n{[n for n in range(4) if rank_of[n] == 0][0]}"].silent
    assert state.safe_step(KEY) is None and state.rank_checks > checks


def test_ranks_saving_out_of_phase_replicate_one_round_step_until_it_is_safe():
    """Data parallelism 1: each rank's newest step differs, yet every rank pushes the round's step (the newest
    every rank holds); the round stands until safe, then moves to the newest step every rank holds by then."""
    state = ClusterState()
    state.expire(0.0)
    nodes = 4
    rank_of = form_job(state, nodes, 1, JobSettings((), 1, None, 100), now=0.0)
    incarnation = state.job(KEY).incarnation.incarnation_id
    targets = state.job(KEY).replica_targets
    replicas: dict[int, list[tuple[int, int]]] = {node: [] for node in range(nodes)}  # node -> (step, rank) it holds

    def heartbeat(newest: dict[int, int], now: float) -> dict[int, list[int]]:
        """Each rank holds its steps 1..newest[rank] and the replicas pushed so far; returns node -> steps ordered."""
        orders = {}
        for node in range(nodes):
            rank = rank_of[node]
            held = [own(s, rank) for s in range(1, newest[rank] + 1)] + [
                HeldStep(*NAMES, s, r, None, replica=True) for s, r in replicas[node]
            ]
            reply = state.apply_report(report(node, [pod(node, nodes, 1, incarnation, rank)], held), now)
            orders[node] = [o.step for o in reply.replicate]
        state.tick(now + decide_interval(nodes))
        return orders

    def push_round(orders: dict[int, list[int]]) -> None:
        for node, steps in orders.items():
            for step in steps:
                replicas[int(targets[rank_of[node]][0][1:])].append((step, rank_of[node]))

    heartbeat({0: 3, 1: 2, 2: 3, 3: 1}, 1.0)
    orders = heartbeat({0: 3, 1: 2, 2: 3, 3: 1}, 1.5)
    assert orders == {node: [1] for node in range(nodes)}  # not each rank's newest (3, 2, 3, 1)
    # Saves go on while the round's pushes run: the round stands until step 1 is safe.
    orders = heartbeat({0: 5, 1: 4, 2: 5, 3: 4}, 2.0)
    assert orders == {node: [1] for node in range(nodes)} and state.safe_step(KEY) is None
    push_round(orders)
    heartbeat({0: 5, 1: 4, 2: 5, 3: 4}, 2.5)
    assert state.safe_step(KEY) == 1
    orders = heartbeat({0: 5, 1: 4, 2: 5, 3: 4}, 3.0)
    assert orders == {node: [4] for node in range(nodes)}  # the newest step every rank holds
    retain = state.job(KEY).retain
    assert (retain.keep_from, retain.protected) == (1, (4,))  # the round's step is never given up under pressure
    push_round(orders)
    heartbeat({0: 6, 1: 6, 2: 6, 3: 5}, 3.5)
    assert state.safe_step(KEY) == 4
