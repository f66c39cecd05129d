"""The coordinator's process and its HTTP API: the aiohttp app (``service``, ``routes``), its settings (``config``),
its tuning (``process_tuning``, ``tls_read_buffer``), ``/metrics`` (``cluster_gauges``), long-poll wake-ups
(``job_changes``), the state dir's snapshots (``settings_snapshot``, ``recovery_snapshot``) and the operator's
client (``status``). The top layer: nothing else in the coordinator imports it.
"""
