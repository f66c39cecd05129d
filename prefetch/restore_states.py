"""The states of one pod's restore and the transitions between them, apart from its I/O.

``Restorer.restore`` (``prefetch/restore.py``) runs the machine: it does what the current state
asks (ask the coordinator for the view, stage the step, report the outcome, hand over) and passes
what came of it to the transition named for it, which returns the next state. The transitions are
pure functions of what the restore knows so far (``Attempts``) and that result:

- ``Asking`` --``viewed``--> ``Staging`` (a plan this rank has not staged), ``Asking`` (a long poll: for
  every rank to stage, or for an identical rank's node to download the step) or ``HandingOver`` (ready);
- ``Staging`` --``staged``--> ``Reporting`` (a source served, or only proven-unusable copies were left),
  or ``Retrying`` (no source served, some were only unreachable);
- ``Retrying`` --``retried``--> ``Asking`` (the backoff, as a long poll that a new plan ends at once);
- ``Reporting`` --``reported``--> ``Asking``;
- any state whose call the coordinator did not answer --``unavailable``--> ``Asking``.

The restore's deadline is checked each time it is ``Asking``; past it, the restore gives up.
"""

import dataclasses

from replicator.pacing import timing
from replicator.wire.messages import MAX_WAIT_SECONDS, BadCopy, RestoreView, Source


@dataclasses.dataclass(frozen=True)
class Staged:
    """What staging a view's step came to (``Restorer._stage``).

    Attributes:
      source: the source that served a verified copy, or None if none did.
      bad: the copies proven unusable, as (step, data rank, holder): reported to the coordinator.
      unreachable: what went wrong with sources that were merely unreachable (to retry), one line each.
      summary: what the rank reports it staged from, when not ``source``'s ``tier:holder`` alone (an
        elastic restore's copies, ``prefetch.resharded``).
    """

    source: Source | None
    bad: list[BadCopy]
    unreachable: list[str]
    summary: str | None = None


@dataclasses.dataclass(frozen=True)
class Attempts:
    """What a restore carries from state to state.

    Attributes:
      reported_generation: the plan generation whose staging outcome this rank reported, or None.
      used: the source of the last outcome (the restore's ``source`` label), or None.
      backoff: seconds the next wait for unreachable sources lasts.
      unusable: (generation, holder, data rank) of the copies proven unusable here: not tried again.
      fan_out: (generation, since): the plan whose downloader this rank waits for, and since when
        (monotonic seconds), or None.
    """

    reported_generation: str | None = None
    used: Source | None = None
    backoff: float = timing.RESTORE_RETRY_FIRST_SECONDS
    unusable: frozenset[tuple[str, str, int]] = frozenset()
    fan_out: tuple[str, float] | None = None


@dataclasses.dataclass(frozen=True)
class Asking:
    """Ask the coordinator for the rank's view: at once (``seen`` None), or a long poll of up to
    ``wait`` seconds that returns when the view's token differs from ``seen``."""

    seen: str | None = None
    wait: float = MAX_WAIT_SECONDS


@dataclasses.dataclass(frozen=True)
class Staging:
    """Stage the view's step from its first source that serves a verified copy; ``downloader_late``
    when an identical rank's node did not download it within the fan-out wait (the store is read)."""

    view: RestoreView
    downloader_late: bool = False


@dataclasses.dataclass(frozen=True)
class Retrying:
    """No source served and some were only unreachable: report the copies proven unusable, if any,
    as retrying (the coordinator does not replan), then wait out the backoff."""

    view: RestoreView
    staged: Staged


@dataclasses.dataclass(frozen=True)
class Reporting:
    """Report the view's staging outcome: the source that served, or None with the copies proven
    unusable (the coordinator replans)."""

    view: RestoreView
    staged: Staged


@dataclasses.dataclass(frozen=True)
class HandingOver:
    """Every rank staged the view's step, or the job starts fresh: record the timeline, write the marker."""

    view: RestoreView


# The states the restore acts in; it ends in ``HandingOver`` (or at its deadline).
Acting = Asking | Staging | Retrying | Reporting
State = Acting | HandingOver


def viewed(attempts: Attempts, view: RestoreView, now: float, fan_out_wait_seconds: float) -> tuple[Attempts, State]:
    """The coordinator answered with ``view`` at ``now`` (monotonic seconds).

    Args:
      fan_out_wait_seconds: how long the rank waits for an identical rank's node to download the
        step from the backup tier before it reads the store itself.

    Returns:
      What the restore knows now, and its next state.
    """
    if view.step is None or view.generation == attempts.reported_generation:
        return attempts, HandingOver(view) if view.ready else Asking(view.token)  # until every rank has staged
    if not view.fan_out_pending:
        return attempts, Staging(view)
    fan_out = attempts.fan_out
    if fan_out is None or fan_out[0] != view.generation:
        fan_out = (view.generation, now)
        attempts = dataclasses.replace(attempts, fan_out=fan_out)
    if (left := fan_out_wait_seconds - (now - fan_out[1])) > 0:
        return attempts, Asking(view.token, left)  # until the downloader has staged (or is silent)
    return attempts, Staging(view, downloader_late=True)


def staged(attempts: Attempts, view: RestoreView, result: Staged) -> tuple[Attempts, State]:
    """Staging ``view``'s step came to ``result``; its copies proven unusable are never tried again.

    Returns:
      What the restore knows now, and its next state: transient is not corrupt, so sources that
      were only unreachable are retried rather than reported.
    """
    unusable = attempts.unusable | {(view.generation, holder, rank) for _, rank, holder in result.bad}
    if result.source is None and result.unreachable:
        return dataclasses.replace(attempts, unusable=unusable), Retrying(view, result)
    return dataclasses.replace(attempts, unusable=unusable, used=result.source), Reporting(view, result)


def retried(attempts: Attempts, view: RestoreView) -> tuple[Attempts, State]:
    """The copies proven unusable were reported (or there were none): wait out the backoff, as a long
    poll that a new plan ends at once, and double it for the next time, up to its cap."""
    backoff = min(2 * attempts.backoff, timing.RESTORE_RETRY_MAX_SECONDS)
    return dataclasses.replace(attempts, backoff=backoff), Asking(view.token, attempts.backoff)


def reported(attempts: Attempts, view: RestoreView) -> tuple[Attempts, State]:
    """The coordinator has the rank's outcome for ``view``'s plan: ask at once for what comes next
    (ready, or a replan), with the backoff reset."""
    first = timing.RESTORE_RETRY_FIRST_SECONDS
    return dataclasses.replace(attempts, reported_generation=view.generation, backoff=first), Asking()


def unavailable(state: State) -> State:
    """The coordinator did not answer the call ``state`` made: the same question again if it was
    asking, else a fresh one (a staging outcome it did not take is staged and reported again)."""
    return state if isinstance(state, Asking) else Asking()
