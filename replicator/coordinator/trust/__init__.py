"""Whom the coordinator trusts: which node an agent is (``node_identity``), which operator may act
(``operator_auth``), which report of a node is taken in (``report_order``), and the grants it signs for peer
reads (``peer_grants``). It imports no other part of the coordinator.
"""
