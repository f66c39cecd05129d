"""Where copies go and how long they stay: replica targets (``replicas``), the safe step and retention
(``retention``), backup scheduling (``backups``). Above ``indices``.
"""
