"""The claim index: which node says it holds which (step, rank) of a job, and whom the coordinator
believes about which rank. Only stores; the policies that read it are ``retention``, ``restores``
and ``backups``.

``walk_ranks`` is one of the coordinator's three hot loops (a 10,000-rank job's step is walked rank
by rank), kept a free function over plain data with the belief rule inlined; ``HeldMemo`` keeps its
answers until a claim of the step, a belief or a node's liveness changes.
"""

from typing import Any

import msgspec

from replicator.wire.messages import JobRef


class Claim(msgspec.Struct, frozen=True, gc=False):
    """A node's claim to hold a copy: ``job``'s ``step`` of ``rank``, a replica or the node's own
    data, written in ``timeline`` (``messages.in_lineage``); a replica's ``content`` (``HeldStep.content``)
    makes a replica of other bytes another claim."""

    job: JobRef
    step: int
    rank: int
    replica: bool
    timeline: int
    content: int | None = None


class ClaimIndex:
    """(step, rank) -> {node: replica?}: every copy some node says it holds, believed or not.

    Attributes:
      holders: (step, rank) -> {node id: whether its copy is a replica}.
      step_ranks: step -> how many ranks ``holders`` holds a copy of: a step is looked at rank by
        rank only when this says every rank may be there.
      step_stamps: step -> bumped whenever a claim of it changes (``HeldMemo``'s stamp).
    """

    __slots__ = ("holders", "step_ranks", "step_stamps")

    def __init__(self) -> None:
        self.holders: dict[tuple[int, int], dict[str, bool]] = {}
        self.step_ranks: dict[int, int] = {}
        self.step_stamps: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.holders)

    def add(self, step: int, rank: int, node_id: str, replica: bool) -> None:
        holders = self.holders.get((step, rank))
        if holders is None:
            holders = self.holders[(step, rank)] = {}
            self.step_ranks[step] = self.step_ranks.get(step, 0) + 1
        holders[node_id] = replica
        self.step_stamps[step] = self.step_stamps.get(step, 0) + 1

    def drop(self, step: int, rank: int, node_id: str) -> None:
        holders = self.holders.get((step, rank))
        if holders is None or holders.pop(node_id, None) is None:
            return
        self.step_stamps[step] = self.step_stamps.get(step, 0) + 1
        if holders:
            return
        del self.holders[(step, rank)]
        if self.step_ranks[step] > 1:
            self.step_ranks[step] -= 1
        else:
            del self.step_ranks[step]

    def of(self, step: int, rank: int) -> dict[str, bool]:
        """The holders of (step, rank): node -> replica? (empty if none)."""
        return self.holders.get((step, rank), {})

    def newest_own(self) -> dict[str, dict[int, int]]:
        """Node -> rank -> the newest step of that rank's own data (not replicas) the node holds."""
        newest: dict[str, dict[int, int]] = {}
        for (step, rank), holders in self.holders.items():
            for node_id, replica in holders.items():
                # Own data only: a node holding a replica of another rank keeps its own rank.
                if not replica:
                    ranks = newest.setdefault(node_id, {})
                    ranks[rank] = max(ranks.get(rank, -1), step)
        return newest

    def sweep_stamps(self) -> None:
        """Forgets the stamps of steps no longer held (with ``HeldMemo``'s answers for them)."""
        for step in [s for s in self.step_stamps if s not in self.step_ranks]:
            del self.step_stamps[step]


class Beliefs:
    """Whom the coordinator believes about a rank's data: the current incarnation's nodes for their ranks, the replica
    targets it ordered, and the copies believed when an earlier incarnation ended. Reset with each incarnation
    (``assign``): a node that once ran a rank is not believed about that rank's new steps once another incarnation
    runs it elsewhere.

    Attributes:
      rank_nodes: rank -> the node the current incarnation put it on (a set, for the walk's lookup): only it is
        believed about new steps of that rank's own data.
      members: the current incarnation's nodes (the nodes the job runs on).
      former: the nodes of the incarnation before it: their listings of the job's backups are still believed (the
        node that committed the newest backup, then was lost, listed it last).
      ordered: (rank, node) replica targets the coordinator chose in this incarnation: only they are believed about
        new replicas of that rank.
      kept: (step, rank) -> nodes whose copy of it was believed when an earlier incarnation ended: still believed
        (a restore source, a safe copy), until the node stops claiming it.
      stamp: bumped whenever any of them changes.
    """

    __slots__ = ("former", "kept", "members", "ordered", "rank_nodes", "stamp")

    def __init__(self) -> None:
        self.rank_nodes: dict[int, set[str]] = {}
        self.members: set[str] = set()
        self.former: set[str] = set()
        self.ordered: set[tuple[int, str]] = set()
        self.kept: dict[tuple[int, int], set[str]] = {}
        self.stamp = 0

    def believed(self, node_id: str, step: int, rank: int, replica: bool) -> bool:
        """Whether a node's claim to hold a copy counts: data of a rank the current incarnation assigned it (its own
        steps, or a step a restore set aside), a replica the coordinator ordered it to hold, or a copy it was
        believed about when an earlier incarnation ended. Anything else (an invented node, a rank it never had, or
        a rank it no longer runs) can neither make other nodes delete data nor serve a restore."""
        return (
            node_id in self.rank_nodes.get(rank, ())
            or (replica and (rank, node_id) in self.ordered)
            or node_id in self.kept.get((step, rank), ())
        )

    def runs(self, node_id: str, rank: int) -> bool:
        """Whether the current incarnation put ``rank`` on the node: only it may rewrite the rank's steps."""
        return node_id in self.rank_nodes.get(rank, ())

    def assign(self, node_of_rank: dict[int, str], holders: dict[tuple[int, int], dict[str, bool]]) -> None:
        """A new incarnation put these nodes on these ranks: they alone are believed about new steps; the copies
        believed until now (of ``holders``, the claim index) are kept."""
        kept: dict[tuple[int, int], set[str]] = {}
        for (step, rank), nodes in holders.items():
            if believed := {node for node, replica in nodes.items() if self.believed(node, step, rank, replica)}:
                kept[(step, rank)] = believed
        self.kept = kept
        self.rank_nodes = {rank: {node} for rank, node in node_of_rank.items()}
        self.former, self.members = self.members, set(node_of_rank.values())
        self.ordered = set()
        self.stamp += 1

    def order(self, targets: dict[int, list[str]]) -> None:
        """The coordinator ordered these replica targets (rank -> nodes)."""
        self.ordered.update((rank, node) for rank, nodes in targets.items() for node in nodes)
        self.stamp += 1

    def drop(self, step: int, rank: int, node_id: str) -> None:
        """The node no longer claims (step, rank): if it claims it again, only the current incarnation vouches."""
        nodes = self.kept.get((step, rank))
        if nodes is not None and node_id in nodes:
            nodes.discard(node_id)
            if not nodes:
                del self.kept[(step, rank)]
            self.stamp += 1


def walk_ranks(
    holders: dict[tuple[int, int], dict[str, bool]],
    beliefs: Beliefs,
    states: dict[str, Any],
    step: int,
    ranks: int,
    wanted: int,
    live_only: bool,
) -> tuple[bool, int]:
    """Whether each of ranks 0..ranks-1 of ``step`` has at least ``wanted`` believed copies on nodes
    of ``states`` not silent (``live_only``) or not given up; stops at the first rank short.

    Returns:
      (the answer, how many ranks were looked at).
    """
    rank_nodes, ordered, kept = beliefs.rank_nodes, beliefs.ordered, beliefs.kept
    for rank in range(ranks):
        found = 0
        for node_id, replica in holders.get((step, rank), {}).items():
            state = states.get(node_id)
            # ``Beliefs.believed``, inlined: this runs for every rank of a 10,000-rank job.
            if (
                state is not None
                and not (state.silent if live_only else state.given_up)
                and (
                    node_id in rank_nodes.get(rank, ())
                    or (replica and (rank, node_id) in ordered)
                    or (kept and node_id in kept.get((step, rank), ()))
                )
            ):
                found += 1
        if found < wanted:
            return False, rank + 1
    return True, ranks


class HeldMemo:
    """``walk_ranks``'s answers, each with the stamp it holds for: (the step's claim stamp, the
    beliefs' stamp, liveness's stamp). A complete step is walked once, not once a pass."""

    __slots__ = ("answers",)

    def __init__(self) -> None:
        self.answers: dict[tuple[int, int, int, bool], tuple[tuple[int | None, int, int], bool]] = {}

    def every_rank_held(
        self,
        claims: ClaimIndex,
        beliefs: Beliefs,
        states: dict[str, Any],
        liveness_stamp: int,
        step: int,
        ranks: int,
        wanted: int,
        live_only: bool,
    ) -> tuple[bool, int]:
        """``walk_ranks`` for a step every rank may hold (``ClaimIndex.step_ranks``), else False at
        once; answered from memory while the stamps hold. Returns (the answer, ranks looked at)."""
        if claims.step_ranks.get(step, 0) < ranks:
            return False, 0
        stamp = (claims.step_stamps.get(step), beliefs.stamp, liveness_stamp)
        key = (step, ranks, wanted, live_only)
        cached = self.answers.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1], 0
        held, checks = walk_ranks(claims.holders, beliefs, states, step, ranks, wanted, live_only)
        self.answers[key] = (stamp, held)
        return held, checks

    def sweep(self, step_stamps: dict[int, int]) -> None:
        """Forgets the answers of steps without a stamp: a stamp counted anew never meets an old answer."""
        self.answers = {k: v for k, v in self.answers.items() if k[0] in step_stamps}
