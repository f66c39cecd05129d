"""Which node reports are taken in: only one newer than the last taken from that node.

A report is the node's whole state, so an old one taken in after a newer one undoes what the newer one
said. That happens on real networks: a report sent while a node was cut off, retransmitted by TCP after
the cut healed, reached the coordinator 30 s late, after the node's new pod had joined a new incarnation;
taken in, its old pod list ended that incarnation for good (found by the chaos suite's partitions).

Each agent process picks a random session id and numbers its reports (``REPORT_ORDER_HEADER``). A report
is taken in when it is of the node's current session and numbered above the last one taken, or of a new
session (the agent restarted); a session replaced by a newer one is never taken in again. Reports
without the header (agents of earlier versions) are taken in as before.
"""

import re

_ORDER = re.compile(r"^([0-9a-f]{16,64}):(\d{1,18})$")
_RETIRED_KEPT = 8  # replaced sessions remembered per node: one per agent restart


class StaleReport(Exception):
    """A report older than one already taken in from its node."""


def parse(value: str | None) -> tuple[str, int] | None:
    """``(session, sequence)`` from the header's value, or None without one.

    Raises:
      ValueError: a value that is not ``<hex session>:<sequence>``.
    """
    if value is None:
        return None
    match = _ORDER.match(value)
    if not match:
        raise ValueError(f"header value {value[:80]!r} is not <hex session>:<sequence>")
    return match.group(1), int(match.group(2))


class ReportOrder:
    """The newest report taken in per node, as (session, sequence), and the sessions replaced since."""

    def __init__(self) -> None:
        self._newest: dict[str, tuple[str, int]] = {}
        self._retired: dict[str, list[str]] = {}

    def is_newest(self, node_id: str, order: tuple[str, int] | None) -> bool:
        """Whether the report numbered ``order``, taken in, is still the node's newest (a held long poll
        applies its report again only then)."""
        return order is None or self._newest.get(node_id) in (None, order)

    def admit(self, node_id: str, order: tuple[str, int] | None) -> None:
        """Records ``order`` as the node's newest report.

        Raises:
          StaleReport: a report numbered ``order`` is older than one already taken in from the node.
        """
        if order is None:
            return
        newest = self._newest.get(node_id)
        if newest is not None:
            self._check(node_id, order, newest)
            if newest[0] != order[0]:
                self._retired[node_id] = [*self._retired.get(node_id, ()), newest[0]][-_RETIRED_KEPT:]
        self._newest[node_id] = order

    def _check(self, node_id: str, order: tuple[str, int], newest: tuple[str, int]) -> None:
        session, sequence = order
        if session in self._retired.get(node_id, ()):
            raise StaleReport(
                f"report {sequence} of node {node_id} comes from agent session {session}, replaced since by {newest[0]}"
            )
        if session == newest[0] and sequence <= newest[1]:
            raise StaleReport(
                f"report {sequence} of node {node_id} is not newer than report {newest[1]}, already taken in"
            )
