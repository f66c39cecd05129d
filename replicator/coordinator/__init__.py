"""The coordinator: one process per cluster (``mtc coordinator``), holding soft state only.

Its sub-packages, top to bottom (the import contracts in ``pyproject.toml`` hold them to this order):

- ``api``: the process and its HTTP API (``service``, ``routes``; typed bodies: ``replicator.wire.messages``),
  ``/metrics``, the state dir's snapshots, and ``status``, the operator's client;
- ``kube`` (the API server's view of job shapes) and ``trust`` (node identity, operator identity, report order,
  peer grants), which know nothing of each other nor of the state;
- ``state``: ``ClusterState``, the one façade over the state's parts; only it bumps versions;
- ``planning``: restore plans and views, the operator's rollback, parity groups and decodes, elastic restores,
  what a restart must recover, the query and status views;
- ``copies``: the decision pass's policies: replica targets, the safe step and retention, backups;
- ``indices``: the stores (``job``, ``claims``, ``identical_ranks``, ``incarnations``, ``liveness``,
  ``parity_orders``), timelines (``lineage``) and the sync step (``sync``) that feeds reports into them;
- ``planner``: pure decisions (ranks, replica targets, restore plans).

It imports nothing node-side: agents and the coordinator share only ``replicator.wire``.
"""
