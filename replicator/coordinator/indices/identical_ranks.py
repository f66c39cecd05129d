"""Data-parallel identity: which ranks of a job hold the same data at a step.

Identity rests on the job's ``assume-data-parallelism`` promise plus evidence: both ranks committed
the step, and their owners' logical signatures (``orbax_protocol.logical_signature``, computed by
the agents) are equal. No data moves to establish it. Each (step, pair) is compared once
(``Identity.compare``, one of the coordinator's three hot loops, over plain dicts); once established
it is recorded until no copy of the step is left.
"""

from collections.abc import Iterator, Mapping

from replicator.wire.messages import JobSettings


class Identity:
    """Peers, owner signatures and the ranks found identical, per step.

    Attributes:
      data_parallelism: the largest the job's ranks declared.
      peers: rank -> its data-parallel peers (both ways).
      new_pairs: (rank, peer), rank < peer, that became peers since the last ``compare``.
      signatures: (step, rank) -> the believed owner's logical signature of the step.
      uncompared: (step, rank) signatures recorded since the last ``compare``.
      covered: step -> the ranks found to hold the same data as a data-parallel peer; kept after a
        rank's copy is lost, which is exactly when it is needed. Pairs are not stored: at 10,000
        ranks of 40 slices they were 390,000 tuples a step, and most of what the garbage collector
        visited.
      stamp: bumped whenever ``covered`` changes.
      changed_at: step -> ``stamp`` when that step's ``covered`` last changed (absent: not since it was
        forgotten or first seen).
    """

    __slots__ = ("changed_at", "covered", "data_parallelism", "new_pairs", "peers", "signatures", "stamp", "uncompared")

    def __init__(self) -> None:
        self.data_parallelism = 1
        self.peers: dict[int, set[int]] = {}
        self.new_pairs: set[tuple[int, int]] = set()
        self.signatures: dict[tuple[int, int], str] = {}
        self.uncompared: set[tuple[int, int]] = set()
        self.covered: dict[int, set[int]] = {}
        self.stamp = 0
        self.changed_at: dict[int, int] = {}

    def add_peers(self, rank: int, settings: JobSettings) -> None:
        """A rank's settings: its data-parallel peers are peers both ways. The signatures of a new
        pair are compared in the next ``compare`` (once, not per rank's settings)."""
        self.data_parallelism = max(self.data_parallelism, settings.data_parallelism)
        for peer in settings.peer_ranks:
            if peer not in self.peers.get(rank, ()):
                self.peers.setdefault(rank, set()).add(peer)
                self.peers.setdefault(peer, set()).add(rank)
                self.new_pairs.add((min(rank, peer), max(rank, peer)))

    def add_signature(self, step: int, rank: int, signature: str) -> None:
        """The believed owner's signature of (step, rank), if none is recorded yet."""
        if (step, rank) not in self.signatures:
            self.signatures[(step, rank)] = signature
            self.uncompared.add((step, rank))

    def identical_peers(self, step: int, rank: int) -> list[int]:
        """The data-parallel peers of ``rank`` whose owners' signatures of ``step`` equal its own."""
        mine = self.signatures.get((step, rank))
        if mine is None:
            return []
        return [other for other in self.peers.get(rank, ()) if self.signatures.get((step, other)) == mine]

    def compare(self) -> int:
        """Compares each new signature with its peers' and each new pair's signatures, each
        (step, pair) once: when the later of its two signatures arrives (by the higher rank if both
        arrived since the last call), or when the two ranks become peers. Returns the comparisons made."""
        checks = 0
        new, self.uncompared = self.uncompared, set()
        signatures, peers = self.signatures, self.peers
        for step, rank in new:
            # Inlined: a 40-slice job's step is 10,000 signatures of 39 peers each.
            mine, same = signatures[(step, rank)], []
            for other in peers.get(rank, ()):
                theirs = signatures.get((step, other))
                if theirs is not None and not (other > rank and (step, other) in new):
                    checks += 1
                    if theirs == mine:
                        same.append(other)
            if same:
                self._record(step, same + [rank])
        if self.new_pairs:
            steps = {step for step, _ in signatures}
            for rank, other in self.new_pairs:
                for step in steps:
                    if (
                        (step, rank) in signatures
                        and (step, other) in signatures
                        and (step, rank) not in new
                        and (step, other) not in new
                    ):
                        checks += 1
                        if signatures[(step, rank)] == signatures[(step, other)]:
                            self._record(step, [rank, other])
            self.new_pairs.clear()
        return checks

    def _record(self, step: int, ranks: list[int]) -> None:
        """Each of ``ranks`` holds the same data as a data-parallel peer at ``step``."""
        self.covered.setdefault(step, set()).update(ranks)
        self._changed(step)

    def _changed(self, step: int) -> None:
        self.stamp += 1
        self.changed_at[step] = self.stamp

    def supersede(self, step: int, rank: int) -> None:
        """The rank's step now holds other bytes: its signature and the identities resting on it go."""
        self.signatures.pop((step, rank), None)
        if (covered := self.covered.get(step)) is not None:
            covered.discard(rank)
            covered -= {
                other
                for other in self.peers.get(rank, ())
                if other in covered and not self.identical_peers(step, other)
            }
            self._changed(step)

    def forget_above(self, lowest: int) -> None:
        """A rollback to ``lowest``: the signatures and identities of newer steps are abandoned."""
        for key in [k for k in self.signatures if k[0] > lowest]:
            del self.signatures[key]
        self.uncompared = {k for k in self.uncompared if k[0] <= lowest}
        for step in [s for s in self.covered if s > lowest]:
            del self.covered[step]
            self.changed_at.pop(step, None)

    def forget_gone(self, steps: frozenset[int]) -> None:
        """Signatures and identities of steps not in ``steps`` (no copy or backup holds them)."""
        for key in [k for k in self.signatures if k[0] not in steps]:
            del self.signatures[key]
        for step in set(self.covered) - steps:
            del self.covered[step]
            self.changed_at.pop(step, None)

    def pairs(self) -> Mapping[int, frozenset[tuple[int, int]]]:
        """Step -> pairs of data-parallel peer ranks (both orders) established identical at that
        step; empty without data parallelism."""
        return IdenticalPairs(self) if self.data_parallelism >= 2 else {}


class IdenticalPairs(Mapping[int, frozenset[tuple[int, int]]]):
    """Step -> the pairs of peer ranks found identical, each step's listed when first looked up: a
    restore plan looks at one or two steps of the three held."""

    def __init__(self, identity: Identity):
        self._identity = identity
        self._listed: dict[int, frozenset[tuple[int, int]]] = {}

    def __getitem__(self, step: int) -> frozenset[tuple[int, int]]:
        covered = self._identity.covered
        if step not in covered:
            raise KeyError(step)
        if step not in self._listed:
            self._listed[step] = frozenset(
                (rank, other) for rank in covered[step] for other in self._identity.identical_peers(step, rank)
            )
        return self._listed[step]

    def __iter__(self) -> Iterator[int]:
        return iter(self._identity.covered)

    def __len__(self) -> int:
        return len(self._identity.covered)


class LeaderMemo:
    """The identical group of each rank at one step (who uploads its backup, ``backups.orders``), kept while the
    identities at that step hold: the signatures of newer steps, compared about once a second
    while the job trains, do not clear it."""

    __slots__ = ("groups", "stamp", "waits")

    def __init__(self) -> None:
        self.stamp: tuple[int, int | None] | None = None  # (step, ``Identity.changed_at`` of the step)
        self.groups: dict[int, tuple[int, ...]] = {}
        # (rank, uploader) -> whether the rank's upload waits for the uploader's (``backups.waits_for``).
        self.waits: dict[tuple[int, int], bool] = {}

    def group(self, identity: Identity, step: int, rank: int) -> tuple[int, ...]:
        """``rank`` and the ranks found identical to it at ``step``, sorted: kept per (step, rank)
        until more ranks are found identical (a report must not walk 39 peers each time)."""
        if self.stamp != (stamp := (step, identity.changed_at.get(step))):
            self.stamp, self.groups, self.waits = stamp, {}, {}
        group = self.groups.get(rank)
        if group is None:
            group = self.groups[rank] = tuple(
                sorted(
                    [rank] + (identity.identical_peers(step, rank) if rank in identity.covered.get(step, ()) else [])
                )
            )
        return group
