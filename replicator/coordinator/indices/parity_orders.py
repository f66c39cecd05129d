"""The parity order index: which node the coordinator ordered to build which shard of a group's step, and over
which basis. Only stores; ``parity`` places the orders and is the policy that reads them.

A node's shard counts (safety, decoding, recipes) only where it matches an order made out to that node: the same
step, group, parity, stripe and shard index, over the same basis. Replica claims are believed the same way
(``claims.Beliefs.ordered``). The index is soft state: a restarted coordinator has none and orders its round's
step again (``parity.place_orders``); shards a node already holds for such an order count once it is placed. With
``--state-dir`` it keeps them (``recovery``): a restarted coordinator believes the shards it had ordered, also of a
lost member's group, whose order it could not place again without the lost member's checksums.
"""

from collections.abc import Callable

import msgspec

from replicator.wire.messages import HeldShard


class ShardSlot(msgspec.Struct, frozen=True, gc=False):
    """One parity shard of a group's step: stripe ``stripe``'s shard ``index`` of ``members``' ``step``, at
    ``parity`` shards per stripe (``replicator.parity.layout.GroupLayout.held_by`` says which position holds it)."""

    step: int
    members: tuple[int, ...]
    parity: int
    stripe: int
    index: int


class ParityOrders:
    """node -> {slot: the basis (``redundancy.basis``) it was ordered to build the slot over}.

    Keyed by node first: a forgotten node's orders go in one step, and a lookup is two dict reads.
    """

    __slots__ = ("_slots_at", "ordered", "stamp")

    def __init__(self) -> None:
        self.ordered: dict[str, dict[ShardSlot, str]] = {}
        self.stamp = 0  # bumped whenever an order is made or forgotten
        self._slots_at: dict[int, int] = {}  # step -> how many slots of it are ordered, kept as orders change

    def order(self, node_id: str, slots: list[ShardSlot], basis: str) -> bool:
        """The coordinator orders ``node_id`` to build ``slots`` over ``basis`` (an order of a slot over another
        basis, an older step's bytes, is replaced). Returns whether any of it is new."""
        mine = self.ordered.setdefault(node_id, {})
        new = False
        for slot in slots:
            if (was := mine.get(slot)) != basis:
                if was is None:
                    self._count(slot.step, 1)
                mine[slot], new = basis, True
        self.stamp += new
        return new

    def steps(self) -> frozenset[int]:
        """The steps some order is of."""
        return frozenset(self._slots_at)

    def _count(self, step: int, by: int) -> None:
        if left := self._slots_at.get(step, 0) + by:
            self._slots_at[step] = left
        else:
            del self._slots_at[step]

    def basis_of(self, node_id: str, slot: ShardSlot) -> str | None:
        """The basis ``node_id`` was last ordered to build ``slot`` over, or None if it never was."""
        return self.ordered.get(node_id, {}).get(slot)

    def believed(self, node_id: str, shard: HeldShard) -> bool:
        """Whether ``node_id`` was ordered to build ``shard``'s slot over ``shard.basis``."""
        slot = ShardSlot(shard.step, shard.members, shard.parity, shard.stripe, shard.index)
        return self.basis_of(node_id, slot) == shard.basis

    def forget_node(self, node_id: str) -> None:
        """The node is forgotten: a node that comes back under its name is ordered anew."""
        if (mine := self.ordered.pop(node_id, None)) is not None:
            for slot in mine:
                self._count(slot.step, -1)
            self.stamp += 1

    def forget_steps(self, keep: Callable[[int], bool]) -> None:
        """Orders of steps ``keep`` refuses (held in no tier, or of an abandoned timeline)."""
        for node_id in list(self.ordered):
            mine = {slot: basis for slot, basis in self.ordered[node_id].items() if keep(slot.step)}
            if len(mine) != len(self.ordered[node_id]):
                for slot in self.ordered[node_id].keys() - mine.keys():
                    self._count(slot.step, -1)
                self.stamp += 1
            if mine:
                self.ordered[node_id] = mine
            else:
                del self.ordered[node_id]
