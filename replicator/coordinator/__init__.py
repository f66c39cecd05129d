"""The coordinator: one process per cluster (``mtc coordinator``), holding soft state only.

- ``service``: the HTTP API node agents and operators call.
- ``state``: nodes, jobs, incarnations and the indices kept up to date from reports.
- ``planner``: pure decisions (ranks, replica targets, restore plans).
- ``status``: the operator's client (``mtc status``, ``mtc restore-from``).

It imports nothing node-side: agents and the coordinator share only ``replicator.wire.messages``.
"""
