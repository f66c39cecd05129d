"""Restore planning and the queries over a job: restore plans and views (``restores``), the operator's rollback
(``rollbacks``), erasure-coded groups and decodes (``parity``), elastic restores (``elastic``), what a restart
must recover (``recovery``), and read-only views (``views``). Above ``copies`` and ``indices``; the pure decisions
are ``replicator.coordinator.planner``.
"""
