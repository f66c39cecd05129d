"""The coordinator's trust decisions as pure functions of reports and time (no HTTP, no processes)."""

import msgspec
import pytest

from replicator.coordinator.state import ClusterState, NodeIdTaken, NotReady
from replicator.wire.messages import BackedUp, HeldStep, Lineage, files_digest
from tests.helpers.coordinator import KEY, NAMES, OWN, SETTINGS, held_by, pod, report, running_job
from tests.helpers.reports import pod_report


def test_restore_sources_carry_the_owners_checksums_not_the_holders():
    state = ClusterState()
    state.expire(0.0)  # the coordinator started at 0 and has heard every node since
    incarnation, node_rank = running_job(state, now=20.0)
    rank = node_rank["b"]
    view = state.restore.view(KEY, incarnation, rank, now=20.5)
    assert view.step == 5
    assert [(s.holder, s.files) for s in view.sources] == [("b", OWN[rank]), ("a", OWN[rank])]


def test_claims_of_unassigned_nodes_count_for_nothing():
    state = ClusterState()
    running_job(state)
    before = state.safe_step(KEY)
    forged = [HeldStep(*NAMES, 10**9, rank, OWN[rank], replica) for rank in (0, 1) for replica in (False, True)]
    for ghost in ("ghost-1", "ghost-2"):
        state.apply_report(report(ghost, f"http://{ghost}", (), forged), 0.5)
    assert {c.step for c in state.copies(KEY)} == {5}
    assert state.safe_step(KEY) == before == 5


def test_a_complete_backup_counts_as_a_holder_while_the_replicas_are_in_flight():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state)
    for index, node in enumerate(("a", "b")):  # step 7 is committed everywhere, not replicated yet
        held = [*held_by(node, rank_of), HeldStep(*NAMES, 7, rank_of[node], OWN[rank_of[node]])]
        state.apply_report(report(node, f"http://{node}", [pod(index, incarnation, rank_of[node])], held), 1.0)
    state.tick(3.0)
    assert state.safe_step(KEY) == 5  # one holder of step 7 per rank: not safe in the cluster
    lister = state.liveness.nodes["a"].report
    state.apply_report(
        msgspec.structs.replace(lister, has_backup=True, backed_up=(BackedUp(*NAMES, ((7, 0),), 4.0),)), 4.0
    )
    state.tick(6.0)
    assert state.safe_step(KEY) == 7 and state.job(KEY).retain.keep_from == 7  # GC may delete step 5 now
    # A backup of a step some rank's node does not hold is not enough: its copies there are what GC keeps.
    state.apply_report(
        msgspec.structs.replace(lister, has_backup=True, backed_up=(BackedUp(*NAMES, ((7, 0), (9, 0)), 7.0),)), 7.0
    )
    state.tick(9.0)
    assert state.safe_step(KEY) == 7


def test_a_node_id_is_bound_to_its_url_until_it_falls_silent():
    state = ClusterState(node_timeout_seconds=15.0)
    state.apply_report(report("a", "http://a"), 0.0)
    with pytest.raises(NodeIdTaken, match="http://a"):
        state.apply_report(report("a", "http://evil"), 5.0)
    assert state.liveness.nodes["a"].report.url == "http://a"
    state.apply_report(report("a", "http://a-restarted"), 20.0)  # silent past the timeout: a new registration
    assert state.liveness.nodes["a"].report.url == "http://a-restarted"


def test_a_silent_node_keeps_its_pods_in_the_incarnation_and_gets_orders_again_when_back():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=0.0)
    # a is frozen for 40 s: past the node timeout, within the grace period.
    reply = state.apply_report(
        report("b", "http://b", [pod(1, incarnation, rank_of["b"])], held_by("b", rank_of)), 40.0
    )
    assert state.job(KEY).incarnation.incarnation_id == incarnation
    assert state.operator.status().silent_nodes == ("a",)
    assert all(t.node != "a" for order in reply.replicate for t in order.targets)  # no pushes to a silent node
    assert {c.holder for c in state.copies(KEY, live_only=True)} == {"b"}  # a's copies do not count as safe now
    state.apply_report(report("a", "http://a", [pod(0, incarnation, rank_of["a"])], held_by("a", rank_of)), 41.0)
    assert state.job(KEY).incarnation.incarnation_id == incarnation and state.operator.status().silent_nodes == ()
    assert {c.holder for c in state.copies(KEY, live_only=True)} == {"a", "b"} and state.safe_step(KEY) == 5


def test_a_replacement_pod_ends_the_incarnation_of_a_silent_node():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=0.0)
    lost = next(n for n in ("a", "b") if rank_of[n] == 1)
    replacement = pod_report(KEY, 0, 1, "uid-new", nodes=2, suffix="y", published_at=30.0)
    state.apply_report(report("c", "http://c", [replacement]), 30.0)
    assert state.job(KEY).incarnation is None or state.job(KEY).incarnation.incarnation_id != incarnation
    assert lost in state.liveness.nodes  # its data is still a restore source within the grace period


def test_beliefs_reset_with_each_incarnation_and_keep_only_the_copies_held_then():
    """A JobSet restart puts a's rank on c. What a held when the old incarnation ended still counts (a restore
    source); a's new claims of that rank do not, nor its step 5 claimed again once dropped; c's new claims do."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    state.expire(0.0)
    old, rank_of = running_job(state, now=20.0)
    moved = rank_of["a"]
    state.apply_report(report("a", "http://a", (), held_by("a", rank_of)), 21.0)  # its pod is gone, its data not
    b_pod = pod_report(KEY, 0, 1, "uid-b2", nodes=2, suffix="b2")
    state.apply_report(report("b", "http://b", [b_pod], held_by("b", rank_of)), 21.0)
    state.apply_report(report("c", "http://c", [pod_report(KEY, 0, 0, "uid-c", nodes=2, suffix="c")]), 21.0)
    state.tick(21.0)
    new = state.job(KEY).incarnation
    assert new is not None and new.incarnation_id != old and new.node_of_rank[moved] == "c"

    def copies(step: int) -> set[tuple[int, str]]:
        return {(c.rank, c.holder) for c in state.copies(KEY, with_backups=False) if c.step == step}

    assert copies(5) == {(0, "a"), (1, "a"), (0, "b"), (1, "b")}  # held when the old incarnation ended
    c_pod = pod_report(KEY, 0, 0, "uid-c", new.incarnation_id, moved, SETTINGS, nodes=2, suffix="c")
    late = [*held_by("a", rank_of), HeldStep(*NAMES, 9, moved, OWN[moved]), HeldStep(*NAMES, 10**9, moved, OWN[moved])]
    state.apply_report(report("a", "http://a", (), late), 22.0)
    state.apply_report(report("c", "http://c", [c_pod], [HeldStep(*NAMES, 9, moved, OWN[moved])]), 22.0)
    state.tick(22.0)
    assert copies(9) == {(moved, "c")} and copies(10**9) == set()
    assert state.job(KEY).retain.keep_from <= 5  # a's huge step deletes nothing
    view = state.restore.view(KEY, new.incarnation_id, moved, now=22.5)
    assert view.step == 5 and [s.holder for s in view.sources] == ["a", "b"]  # kept copies serve the moved rank
    state.apply_report(report("a", "http://a", (), held_by("a", rank_of)[1:]), 23.0)  # a drops its own step 5...
    state.apply_report(report("a", "http://a", (), held_by("a", rank_of)), 24.0)  # ...and claims it again
    state.tick(24.0)
    assert copies(5) == {(1 - moved, "a"), (0, "b"), (1, "b")}


def test_restore_waits_for_a_silent_holder_within_grace_then_replans_without_it():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=60.0)
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=0.0)
    rank = rank_of["b"]
    view = state.restore.view(KEY, incarnation, rank, now=30.0)  # both silent since 0, within grace
    assert view.step == 5 and [s.holder for s in view.sources] == ["b", "a"]
    # An unreachable source is retried, never excluded: the plan stays.
    state.restore.staged(KEY, incarnation, view.generation, rank, None, [], retrying=True)
    assert state.restore.view(KEY, incarnation, rank, now=31.0).generation == view.generation
    # Past the grace period every holder of the step is given up: replanned (here to a fresh start).
    later = state.restore.view(KEY, incarnation, rank, now=61.0)
    assert later.generation != view.generation and later.step is None


def test_only_a_proven_bad_copy_is_excluded_and_replans():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    rank = rank_of["b"]
    view = state.restore.view(KEY, incarnation, rank, now=20.5)
    state.restore.staged(KEY, incarnation, view.generation, rank, None, [(5, rank, "b")])
    replanned = state.restore.view(KEY, incarnation, rank, now=21.0)
    assert replanned.generation != view.generation
    assert [s.holder for s in replanned.sources] == ["a"]  # the corrupt copy on b is never planned again


def test_after_a_coordinator_restart_no_plan_before_every_node_could_report():
    state = ClusterState(node_timeout_seconds=15.0)
    incarnation, rank_of = running_job(state, now=100.0)  # a fresh coordinator hears the nodes at 100
    with pytest.raises(NotReady, match="started"):
        state.restore.view(KEY, incarnation, rank_of["a"], now=105.0)
    assert state.restore.view(KEY, incarnation, rank_of["a"], now=116.0).step == 5


def test_restore_from_works_while_the_job_has_no_pods_and_the_next_incarnation_uses_it():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    older = {
        node: [HeldStep(*NAMES, 2, rank_of[node], OWN[rank_of[node]])] + held_by(node, rank_of) for node in ("a", "b")
    }
    for node in ("a", "b"):  # the pods are deleted; the nodes still hold steps 2 and 5
        state.apply_report(report(node, f"http://{node}", [], older[node]), 21.0)
    assert state.job(KEY).incarnation is None
    state.operator.force(KEY, 2)
    with pytest.raises(LookupError, match="step 3"):
        state.operator.force(KEY, 3)
    state.apply_report(report("a", "http://a", [pod(2)], older["a"]), 22.0)
    state.apply_report(report("b", "http://b", [pod(3)], older["b"]), 22.0)
    fresh = state.job(KEY).incarnation
    assert fresh is not None and fresh.incarnation_id != incarnation
    view = state.restore.view(KEY, fresh.incarnation_id, 0, now=22.5)
    assert view.step == 2 and view.rollback  # the ranks delete the abandoned newer steps, not set them aside


def rolled_back_to_2(state, older_steps):
    """A running job whose nodes also hold ``older_steps``; its pods go, ``restore-from 2``, new pods
    come. Returns (rank_of, the new incarnation id, its first restore view of rank 0)."""
    state.expire(0.0)
    _, rank_of = running_job(state, now=20.0)
    held = {
        node: [HeldStep(*NAMES, s, rank_of[node], OWN[rank_of[node]]) for s in older_steps] + held_by(node, rank_of)
        for node in ("a", "b")
    }
    for node in ("a", "b"):
        state.apply_report(report(node, f"http://{node}", [], held[node]), 21.0)
    state.operator.force(KEY, 2)
    for index, node in enumerate(("a", "b")):
        state.apply_report(report(node, f"http://{node}", [pod(index + 2)], held[node]), 22.0)
    fresh = state.job(KEY).incarnation.incarnation_id
    return rank_of, fresh, state.restore.view(KEY, fresh, 0, now=22.5)


def test_a_rollback_starts_a_timeline_whose_reused_step_numbers_never_mix_with_the_abandoned_ones():
    state = ClusterState()
    rank_of, fresh, view = rolled_back_to_2(state, (2,))
    assert (view.step, view.rollback, view.forks) == (2, True, (2,))
    # Step 5 of timeline 0 is abandoned: not a copy any more although the nodes still report it.
    assert {c.step for c in state.copies(KEY)} == {2}
    assert state.reply_for("a").lineages == (Lineage(*NAMES, (2,)),)
    for rank in (0, 1):
        state.restore.staged(KEY, fresh, view.generation, rank, f"local:{'a' if rank == rank_of['a'] else 'b'}", [])
    assert state.restore.view(KEY, fresh, 0, now=22.6).ready and state.job(KEY).forced_step is None

    # Timeline 1 writes step 5 again, with other values; node a still holds timeline 0's replica.
    new = {rank: {"state/a": (10, f"0000000{rank + 5}")} for rank in (0, 1)}
    rank_now = {
        node: state.job(KEY).incarnation.rank_of_pod[f"uid{index + 2}"] for index, node in enumerate(("a", "b"))
    }
    for index, node in enumerate(("a", "b")):
        held = [
            HeldStep(*NAMES, 2, rank_now[node], OWN[rank_now[node]]),
            HeldStep(*NAMES, 5, rank_now[node], new[rank_now[node]], timeline=1),
            HeldStep(*NAMES, 5, 1 - rank_now[node], replica=True),
        ]
        state.apply_report(report(node, f"http://{node}", [pod(index + 2, fresh, rank_now[node])], held), 23.0)
    assert {(c.step, c.holder) for c in state.copies(KEY)} == {(2, "a"), (2, "b"), (5, "a"), (5, "b")}
    assert state.job(KEY).owner_files(5, 0) == new[0]  # the new timeline's checksums, not the abandoned ones

    # The backup tier lists timeline 0's step 5 and timeline 1's step 3: only the latter is the job's.
    listing = BackedUp(*NAMES, ((3, 1), (5, 0)), 24.0)
    a = state.liveness.nodes["a"].report
    state.apply_report(msgspec.structs.replace(a, has_backup=True, backed_up=(listing,)), 24.0)
    assert state.backed_up(KEY) == {3}

    # A node the job never ran on cannot roll it back.
    ghost = msgspec.structs.replace(report("ghost", "http://ghost"), lineages=(Lineage(*NAMES, (2, 0)),))
    state.apply_report(ghost, 24.5)
    assert state.job(KEY).forks == (2,)

    # A restarted coordinator learns the rollback from the nodes and indexes only the lineage.
    again = ClusterState()
    stale = {
        node: [HeldStep(*NAMES, 5, rank_now[node], OWN[rank_now[node]])] for node in ("a", "b")
    }  # timeline 0's, not collected yet
    for index, node in enumerate(("a", "b")):  # the pods still report their incarnation: it is adopted
        again.apply_report(report(node, f"http://{node}", [pod(index + 2, fresh, rank_now[node])], stale[node]), 30.0)
    assert again.job(KEY).incarnation.incarnation_id == fresh and {c.step for c in again.copies(KEY)} == {5}
    again.apply_report(
        msgspec.structs.replace(
            report("a", "http://a", [pod(2, fresh, rank_now["a"])], stale["a"]), lineages=(Lineage(*NAMES, (2,)),)
        ),
        30.5,
    )
    assert again.job(KEY).forks == (2,) and not again.job(KEY).claimed()

    # Every heartbeat carries the rollback (and no checksums: the agents sent them before), the first
    # ones before the incarnation is adopted (the nodes are not yet the job's, so not believed): the
    # unchanged heartbeat after it is looked at again.
    third = ClusterState()
    acked = {node: [HeldStep(*NAMES, 5, rank_now[node])] for node in ("a", "b")}
    reports = {
        node: msgspec.structs.replace(
            report(node, f"http://{node}", [pod(index + 2, fresh, rank_now[node])], acked[node]),
            lineages=(Lineage(*NAMES, (2,)),),
        )
        for index, node in enumerate(("a", "b"))
    }
    for node in ("a", "b"):
        third.apply_report(reports[node], 30.0)
    assert third.job(KEY).incarnation.incarnation_id == fresh and third.job(KEY).forks == ()
    third.apply_report(reports["a"], 31.0)
    assert third.job(KEY).forks == (2,) and not third.job(KEY).claimed()


def test_no_step_a_rollback_may_need_is_collected_while_it_is_pending_or_by_the_abandoned_safe_step():
    state = ClusterState()
    state.expire(0.0)
    _, rank_of = running_job(state, now=20.0)
    state.tick(21.0)
    assert state.safe_step(KEY) == 5 and state.job(KEY).retain.keep_from == 5  # steps 1 and 2 may go
    held = {
        node: [HeldStep(*NAMES, s, rank_of[node], OWN[rank_of[node]]) for s in (1, 2)] + held_by(node, rank_of)
        for node in ("a", "b")
    }
    for node in ("a", "b"):
        state.apply_report(report(node, f"http://{node}", [], held[node]), 21.0)
    state.operator.force(KEY, 2)
    for index, node in enumerate(("a", "b")):  # the new pods: an incarnation without a plan yet
        state.apply_report(report(node, f"http://{node}", [pod(index + 2)], held[node]), 22.0)
    state.tick(23.0)
    assert state.reply_for("a").retain == () and state.reply_for("b").retain == ()  # step 1 is the rollback's fallback
    fresh = state.job(KEY).incarnation.incarnation_id
    assert state.restore.view(KEY, fresh, 0, now=23.5).step == 2
    assert state.reply_for("a").retain == ()  # step 5 was safe, but it is abandoned now


def test_a_rollback_ends_when_its_last_rank_stages_and_a_restore_view_changes_nothing():
    state = ClusterState()
    rank_of, fresh, view = rolled_back_to_2(state, (2,))
    node_of = {rank: node for node, rank in rank_of.items()}
    state.restore.staged(KEY, fresh, view.generation, 0, f"local:{node_of[0]}", [])
    for _ in range(2):  # asked again and again while rank 1 has not staged: the rollback goes on
        assert not state.restore.view(KEY, fresh, 0, now=22.6).ready and state.job(KEY).forced_step == 2
    state.restore.staged(KEY, fresh, view.generation, 1, f"local:{node_of[1]}", [])
    assert state.job(KEY).forced_step is None  # done as the last rank staged, before any rank asks
    # The operator asks for step 2 again: the ready view of the incarnation that restored it leaves the
    # request for the next incarnation.
    state.operator.force(KEY, 2)
    assert state.restore.view(KEY, fresh, 1, now=22.7).ready
    assert (state.job(KEY).forced_step, state.operator.status().jobs[0].pending_rollback) == (2, 2)


def test_a_rollback_to_a_step_that_proves_unrestorable_restores_the_newest_step_before_it_never_a_fresh_start():
    state = ClusterState()
    rank_of, fresh, view = rolled_back_to_2(state, (1, 2))
    node_of = {rank: node for node, rank in rank_of.items()}
    assert (view.step, view.rollback) == (2, True)
    # Rank 0's only copy of step 2 fails its checksums: the rollback step cannot be restored.
    state.restore.staged(KEY, fresh, view.generation, 0, None, [(2, 0, node_of[0])])
    view = state.restore.view(KEY, fresh, 0, now=22.6)
    assert (view.step, view.rollback, view.forks) == (1, False, (2,))  # newer steps are set aside, not deleted
    assert state.job(KEY).forced_step is None


def test_a_step_set_aside_by_a_restore_counts_as_its_nodes_own_copy():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, now=20.0)
    aside = [HeldStep(*NAMES, 9, rank_of[n], replica=True) for n in ("a", "b")]  # both ranks' step 9, set aside
    for index, node in enumerate(("a", "b")):
        state.apply_report(
            report(
                node,
                f"http://{node}",
                [pod(index, incarnation, rank_of[node])],
                held_by(node, rank_of) + [aside[index]],
            ),
            20.2,
        )
    assert {(c.step, c.rank, c.holder) for c in state.copies(KEY) if c.step == 9} == {
        (9, rank_of["a"], "a"),
        (9, rank_of["b"], "b"),
    }
    view = state.restore.view(KEY, incarnation, rank_of["a"], now=20.5)
    assert view.step == 9 and [(s.tier, s.holder) for s in view.sources] == [("local", "a")]


def test_a_step_written_anew_after_a_restore_to_an_older_one_supersedes_its_old_copies():
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, has_backup=True)
    rank = rank_of["b"]
    new = {"_CHECKPOINT_METADATA": (3, "0000000a"), "state/b": (10, "0000000b")}  # the same step number, other bytes
    assert state.job(KEY).backup_pending == 5
    # Node b restored an older step, set its step 5 aside, and the job wrote step 5 again.
    held = [HeldStep(*NAMES, 5, rank, new), HeldStep(*NAMES, 5, rank_of["a"], OWN[rank_of["a"]], replica=True)]
    state.apply_report(report("b", "http://b", [pod(1, incarnation, rank)], held), 1.0)
    state.tick(1.0)
    assert state.job(KEY).owner_files(5, rank) == new
    # Its backup is abandoned for good: the ranks' uploads could be of either version under one COMMIT.
    state.tick(7.0)
    assert state.job(KEY).backup_pending is None
    # Node a's replica of rank b's step 5 is of the old version: no copy, even when a reports it again unchanged.
    state.apply_report(report("a", "http://a", [pod(0, incarnation, rank_of["a"])], held_by("a", rank_of)), 2.0)
    state.tick(2.0)
    assert (5, rank, "a") not in {(c.step, c.rank, c.holder) for c in state.copies(KEY)}
    view = state.restore.view(KEY, incarnation, rank, now=20.0)
    assert view.step == 5 and [(s.holder, s.files) for s in view.sources] == [("b", new)]


def _rewrite_step_5(state, replica_contents, first):
    """A two-node job whose node a holds rank b's replica of step 5 (reported with its content, as agents do); node
    b writes its step 5 anew (other bytes) and node a reports its replica with each of ``replica_contents`` in turn
    (``first``: each a's report before b's, else b's first). Returns whether a's replica counts as a copy after
    each of a's reports, and the new bytes."""
    incarnation, rank_of = running_job(state, has_backup=True)
    rank, other = rank_of["b"], rank_of["a"]
    new = {"_CHECKPOINT_METADATA": (3, "0000000a"), "state/b": (10, "0000000b")}
    digests = {"old": files_digest(OWN[rank]), "new": files_digest(new)}
    own_a = HeldStep(*NAMES, 5, other, OWN[other])
    rewrite = [HeldStep(*NAMES, 5, rank, new), HeldStep(*NAMES, 5, other, replica=True)]
    old_replica = HeldStep(*NAMES, 5, rank, replica=True, content=digests["old"])
    state.apply_report(report("a", "http://a", [pod(0, incarnation, other)], [own_a, old_replica]), 0.5)
    counted, now = [], 1.0
    if not first:
        state.apply_report(report("b", "http://b", [pod(1, incarnation, rank)], rewrite), now)
    for content in replica_contents:
        now += 1.0
        replica = HeldStep(*NAMES, 5, rank, replica=True, content=digests[content])
        state.apply_report(report("a", "http://a", [pod(0, incarnation, other)], [own_a, replica]), now)
        if first:
            state.apply_report(report("b", "http://b", [pod(1, incarnation, rank)], rewrite), now)
        state.tick(now)
        counted.append((5, rank, "a") in {(c.step, c.rank, c.holder) for c in state.copies(KEY)})
    return counted, new


def test_a_replica_of_a_step_written_anew_counts_again_once_its_node_reports_the_new_bytes():
    state = ClusterState()
    state.expire(0.0)
    # Node a still holds the old bytes (not counted), then the push of the new ones lands: its replica counts.
    # Before replicas carried their content, a's report did not change and the replica never counted again: the
    # replication round of step 5 never ended, and nothing newer was replicated until the next incarnation.
    counted, new = _rewrite_step_5(state, ["old", "new"], first=False)
    assert counted == [False, True]
    incarnation = state.job(KEY).incarnation.incarnation_id
    view = state.restore.view(KEY, incarnation, state.job(KEY).incarnation.rank_of_node["b"], now=20.0)
    assert [(s.holder, s.files) for s in view.sources][0] == ("b", new)


def test_a_replica_that_reported_the_new_bytes_before_the_owner_rewrote_the_step_keeps_counting():
    state = ClusterState()
    state.expire(0.0)
    counted, _ = _rewrite_step_5(state, ["new"], first=True)
    assert counted == [True]


def test_the_same_checksums_listed_in_another_order_are_the_same_step_not_a_rewrite():
    # The coordinator keeps checksums packed (sorted JSON): a report of the same manifest in another
    # order must compare equal, and other checksums must not.
    state = ClusterState()
    state.expire(0.0)
    incarnation, rank_of = running_job(state, has_backup=True)
    rank = rank_of["b"]
    first = {"_CHECKPOINT_METADATA": (3, "0000000a"), "state/b": (10, "0000000b")}
    reordered = dict(reversed(first.items()))
    for now, files in ((1.0, first), (2.0, reordered)):
        state.apply_report(
            report("b", "http://b", [pod(1, incarnation, rank)], [HeldStep(*NAMES, 7, rank, files)]), now
        )
        state.tick(now)
    assert 7 not in state.job(KEY)._job.rewritten and state.job(KEY).owner_files(7, rank) == first
    changed = {**first, "state/b": (10, "0000000c")}
    state.apply_report(report("b", "http://b", [pod(1, incarnation, rank)], [HeldStep(*NAMES, 7, rank, changed)]), 3.0)
    state.tick(3.0)
    assert 7 in state.job(KEY)._job.rewritten and state.job(KEY).owner_files(7, rank) == changed
