"""A pod's restore, state by state (``prefetch.restore_states``): each transition on its own, from
what the restore knows so far and what the last call came to, with no coordinator and no copy."""

import dataclasses

from prefetch.restore_states import (
    Asking,
    Attempts,
    HandingOver,
    Reporting,
    Retrying,
    Staged,
    Staging,
    reported,
    retried,
    staged,
    unavailable,
    viewed,
)
from replicator.pacing import timing
from replicator.wire.messages import MAX_WAIT_SECONDS, RestoreView, Source, Tier

FAN_OUT_WAIT = 60.0
PEER = Source(Tier.PEER_CLOSE, "node-b", "https://node-b", 0, None)
BACKUP = Source(Tier.BACKUP, "backup", None, 0, None)


def view(generation: str = "g1", step: int | None = 5, ready: bool = False, pending: bool = False) -> RestoreView:
    return RestoreView(generation, step, (PEER, BACKUP), ready, fan_out_pending=pending)


def test_a_plan_not_staged_yet_is_staged():
    assert viewed(Attempts(), view(), 0.0, FAN_OUT_WAIT) == (Attempts(), Staging(view()))
    # A replan to another generation is staged again, whatever the last one came to.
    attempts = Attempts(reported_generation="g1")
    assert viewed(attempts, view("g2"), 0.0, FAN_OUT_WAIT) == (attempts, Staging(view("g2")))


def test_a_staged_plan_waits_for_every_rank_then_hands_over():
    attempts = Attempts(reported_generation="g1")
    assert viewed(attempts, view(), 0.0, FAN_OUT_WAIT) == (attempts, Asking(view().token, MAX_WAIT_SECONDS))
    assert viewed(attempts, view(ready=True), 0.0, FAN_OUT_WAIT) == (attempts, HandingOver(view(ready=True)))


def test_a_fresh_start_hands_over_at_once():
    fresh = view(step=None, ready=True)
    assert viewed(Attempts(), fresh, 0.0, FAN_OUT_WAIT) == (Attempts(), HandingOver(fresh))


def test_a_rank_waits_for_its_downloader_until_the_fan_out_wait_is_spent_then_reads_the_store():
    pending = view(pending=True)
    attempts, state = viewed(Attempts(), pending, 100.0, FAN_OUT_WAIT)
    assert (attempts.fan_out, state) == (("g1", 100.0), Asking(pending.token, FAN_OUT_WAIT))
    attempts, state = viewed(attempts, pending, 140.0, FAN_OUT_WAIT)  # woken early: the rest of the wait
    assert (attempts.fan_out, state) == (("g1", 100.0), Asking(pending.token, 20.0))
    assert viewed(attempts, pending, 160.0, FAN_OUT_WAIT) == (attempts, Staging(pending, downloader_late=True))


def test_a_new_plan_restarts_the_wait_for_its_downloader():
    attempts = Attempts(fan_out=("g1", 0.0))
    replanned = view("g2", pending=True)
    attempts, state = viewed(attempts, replanned, 500.0, FAN_OUT_WAIT)
    assert (attempts.fan_out, state) == (("g2", 500.0), Asking(replanned.token, FAN_OUT_WAIT))


def test_a_served_copy_is_reported_with_the_copies_proven_unusable_before_it():
    result = Staged(BACKUP, [(5, 0, "node-b")], [])
    attempts, state = staged(Attempts(), view(), result)
    assert state == Reporting(view(), result)
    assert (attempts.used, attempts.unusable) == (BACKUP, {("g1", "node-b", 0)})


def test_no_copy_left_but_proven_unusable_ones_is_reported_for_a_replan():
    result = Staged(None, [(5, 0, "node-b")], [])
    attempts, state = staged(Attempts(used=PEER), view(), result)
    assert state == Reporting(view(), result)
    assert (attempts.used, attempts.unusable) == (None, {("g1", "node-b", 0)})


def test_sources_only_unreachable_are_retried_not_reported_as_bad():
    result = Staged(None, [(5, 0, "node-b")], ["backup: store outage"])
    attempts, state = staged(Attempts(used=PEER), view(), result)
    assert state == Retrying(view(), result)
    assert (attempts.used, attempts.unusable) == (PEER, {("g1", "node-b", 0)})  # the last source label stays


def test_a_retry_waits_out_the_backoff_as_a_long_poll_and_doubles_it_up_to_its_cap():
    attempts, state = retried(Attempts(), view())
    assert state == Asking(view().token, timing.RESTORE_RETRY_FIRST_SECONDS)
    assert attempts.backoff == 2 * timing.RESTORE_RETRY_FIRST_SECONDS
    capped = Attempts(backoff=timing.RESTORE_RETRY_MAX_SECONDS)
    assert retried(capped, view()) == (capped, Asking(view().token, timing.RESTORE_RETRY_MAX_SECONDS))


def test_a_reported_outcome_asks_at_once_with_the_backoff_reset():
    attempts, state = reported(Attempts(backoff=8.0, unusable=frozenset({("g1", "node-b", 0)})), view())
    assert state == Asking()
    assert attempts == Attempts(reported_generation="g1", unusable=frozenset({("g1", "node-b", 0)}))


def test_an_unanswered_call_asks_again():
    long_poll = Asking(view().token, 3.0)
    assert unavailable(long_poll) is long_poll  # the same question
    result = Staged(PEER, [], [])
    assert unavailable(Reporting(view(), result)) == Asking()  # staged and reported again
    assert unavailable(Retrying(view(), dataclasses.replace(result, source=None))) == Asking()
