"""The coordinator: one process per cluster (``mtc coordinator``), holding soft state only.

- ``service``: the HTTP API node agents and operators call (typed bodies: ``replicator.wire.messages``).
- ``status``: the operator's client (``mtc status``, ``mtc restore-from``).
- ``state``: ``ClusterState``, the one façade over the state's parts; only it bumps versions.
- the sync step: ``sync`` (reports into the indices), ``liveness`` (nodes, silence, expiry);
- the indices: ``claims`` (who holds what, whom to believe), ``identity`` (data-parallel
  signatures and identical ranks), ``job`` (a job's data, indices, decisions and memo caches);
- the decision pass: ``incarnations``, ``lineage``, ``replicas``, ``retention``, ``backups``;
- ``restores`` (plans and views), ``views`` (the query API and the status view);
- ``planner``: pure decisions (ranks, replica targets, restore plans).

It imports nothing node-side: agents and the coordinator share only ``replicator.wire.messages``.
"""
