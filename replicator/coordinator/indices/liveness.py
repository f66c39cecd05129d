"""Liveness: the nodes, their last reports and when each was last heard from.

A node silent past the node timeout gets no orders and its copies do not count as safe; silent
past the holder grace period its data is given up (a restore does without it sooner where it can:
``restores.lost_holders``). The heartbeat interval (and so the timeout)
grows with the node count. Only an index and its clock: the jobs a liveness change affects are
the caller's (``ClusterState``) to decide again.
"""

import dataclasses
import logging
from collections.abc import Callable, Iterable

from replicator.coordinator.indices.claims import Claim
from replicator.wire.messages import JobRef, NodeReport

log = logging.getLogger(__name__)

# Heartbeats: the coordinator budgets this many unchanged reports a second for the whole cluster,
# so the interval grows with the node count (1 s up to 1,000 nodes, 10 s at 10,000). Changes are
# reported at once whatever the interval.
HEARTBEATS_PER_SECOND = 1_000.0
MIN_HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 10.0
# A node is silent after missing this many heartbeats (or after --node-timeout, if longer).
_MISSED_HEARTBEATS = 3


@dataclasses.dataclass
class NodeState:
    """The last report of a node (its held steps without their checksums), its claims and liveness."""

    report: NodeReport
    last_seen: float
    claims: frozenset[Claim] = frozenset()
    silent: bool = False  # silent past the node timeout, as of the last ``expire``
    given_up: bool = False  # silent past the holder grace period, as of the last ``expire``

    def job_keys(self) -> set[JobRef]:
        return (
            {JobRef(p.namespace, p.job) for p in self.report.pods}
            | {c.job for c in self.claims}
            | {JobRef(b.namespace, b.job) for b in self.report.backed_up}
        )


class Liveness:
    """The nodes by id, the clock of the newest event, and who is silent.

    Args:
      node_timeout_seconds: a node silent this long (or three heartbeats, if longer) is silent.
      holder_grace_seconds: a silent node's data is given up after this long.

    Attributes:
      nodes: node id -> its state.
      stamp: bumped whenever a node's ``silent`` or ``given_up`` changes, or a node is forgotten.
      backup_nodes: nodes whose last report says they have a backup tier.
      replicas_epoch: bumped when a node reports a ``replicas`` setting it did not before.
      redundancy_epoch: bumped when a node reports a ``redundancy`` setting it did not before.
      now: the time of the newest event applied; started: the time of the first one.
    """

    def __init__(self, node_timeout_seconds: float, holder_grace_seconds: float):
        self.configured_timeout_seconds = node_timeout_seconds
        self.configured_grace_seconds = holder_grace_seconds
        self.nodes: dict[str, NodeState] = {}
        self.stamp = 0
        self.backup_nodes: set[str] = set()
        self.replicas_epoch = 0
        self.redundancy_epoch = 0
        self.now = 0.0
        self.started = float("inf")  # before the first report nothing is known
        self._by_touch: dict[str, None] = {}  # the nodes, least recently heard from first (``expire``)

    @property
    def heartbeat_seconds(self) -> float:
        """How often agents report when nothing changes: grows with the node count. Silent nodes
        count too: were the interval (and the timeout, three intervals) to shrink as nodes fall
        silent, agents still pacing themselves by the longer interval they were told would fall
        silent in turn; at 10,000 nodes that cascade stalled a whole job."""
        return min(MAX_HEARTBEAT_SECONDS, max(MIN_HEARTBEAT_SECONDS, len(self.nodes) / HEARTBEATS_PER_SECOND))

    @property
    def node_timeout_seconds(self) -> float:
        return max(self.configured_timeout_seconds, _MISSED_HEARTBEATS * self.heartbeat_seconds)

    @property
    def holder_grace_seconds(self) -> float:
        return max(self.configured_grace_seconds, self.node_timeout_seconds)

    def advance(self, now: float) -> None:
        self.now = max(self.now, now)
        self.started = min(self.started, now)

    def silence(self, node_id: str) -> float:
        """Seconds since the node last reported (infinite for an unknown node)."""
        state = self.nodes.get(node_id)
        return self.now - state.last_seen if state else float("inf")

    def is_live(self, node_id: str) -> bool:
        return self.silence(node_id) <= self.node_timeout_seconds

    def holds_data(self, node_id: str) -> bool:
        """Whether the node's copies still count as restore sources (silent less than the grace)."""
        return self.silence(node_id) <= self.holder_grace_seconds

    def silent(self) -> list[str]:
        """The nodes silent past the node timeout, oldest first. Nodes are kept in the order they were
        last heard from, so this stops at the first live one: it costs the silent nodes, not the
        cluster (walking 10,000 nodes every second was 7 % of the coordinator)."""
        stale, timeout, now = [], self.node_timeout_seconds, self.now
        for node_id in self._by_touch:
            if now - self.nodes[node_id].last_seen <= timeout:
                break
            stale.append(node_id)
        return stale

    def live_count(self) -> int:
        """How many nodes reported within the node timeout."""
        return len(self.nodes) - len(self.silent())

    def touch(self, node_id: str, now: float) -> NodeState | None:
        """The node is alive at ``now``. Returns its state if it was silent until now (its jobs are
        to be decided again: its copies count again, orders resume), else None."""
        self.advance(now)
        state = self.nodes.get(node_id)
        if state is None:
            return None
        back = state.silent
        if back:
            self.stamp += 1
        state.last_seen, state.silent, state.given_up = now, False, False
        del self._by_touch[node_id]
        self._by_touch[node_id] = None  # to the end: the order stays oldest first
        return state if back else None

    def record(self, node_id: str, state: NodeState, previous: NodeState | None) -> None:
        """Keeps ``state`` as the node's (it replaces ``previous``)."""
        self.nodes[node_id] = state
        self._by_touch.setdefault(node_id, None)
        (self.backup_nodes.add if state.report.has_backup else self.backup_nodes.discard)(node_id)
        if previous is None or previous.report.replicas != state.report.replicas:
            self.replicas_epoch += 1
        if previous is None or previous.report.redundancy != state.report.redundancy:
            self.redundancy_epoch += 1

    def expire(self, now: float, in_use: Callable[[], set[str]]) -> tuple[list[str], list[NodeState]]:
        """Marks nodes silent or given up, and picks those to forget: silent past the grace period
        and in no incarnation (``in_use()``: the nodes incarnations hold; asked at most once).

        Returns:
          (the nodes to forget, still recorded: the caller drops their claims, then ``forget``s them;
          the nodes whose liveness changed: their jobs are to be decided again).
        """
        self.advance(now)
        timeout, grace = self.node_timeout_seconds, self.holder_grace_seconds
        used: set[str] | None = None
        forget: list[str] = []
        changed: list[NodeState] = []
        for node_id in self.silent():
            state = self.nodes[node_id]
            silence = self.now - state.last_seen
            if silence > grace and used is None:
                used = in_use()
            if silence > grace and used is not None and node_id not in used:
                log.warning("node %s silent for %.0f s: forgetting it and its data", node_id, silence)
                forget.append(node_id)
            elif silence > timeout and not state.silent:
                state.silent = True
                self.stamp += 1
                changed.append(state)
                log.warning(
                    "node %s silent for %.0f s: no orders to it; its pods stay in their incarnation and its "
                    "copies stay restore sources for %.0f s",
                    node_id,
                    silence,
                    grace,
                )
            elif silence > grace and not state.given_up:
                state.given_up = True
                self.stamp += 1
                changed.append(state)  # its data is given up: the job's plans and safety change
        return forget, changed

    def forget(self, node_id: str) -> None:
        del self.nodes[node_id], self._by_touch[node_id]
        self.backup_nodes.discard(node_id)
        self.stamp += 1

    def blocks(self, node_ids: Iterable[str]) -> dict[str, str]:
        """Node -> its ``block`` topology label, for the known ones of ``node_ids``."""
        return {n: self.nodes[n].report.topology.get("block", "") for n in node_ids if n in self.nodes}

    def url(self, node_id: str) -> str | None:
        state = self.nodes.get(node_id)
        return state.report.url if state else None
