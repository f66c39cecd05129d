"""What the coordinator knows, stored: a job (``job``), who holds what (``claims``), which ranks hold the same data
(``identical_ranks``), incarnations (``incarnations``), nodes and their silence (``liveness``), parity orders
(``parity_orders``), timelines (``lineage``), and the sync step that feeds reports into them (``sync``). Stores
and the sync step only; the policies that read them are in ``copies`` and ``planning``.
"""
