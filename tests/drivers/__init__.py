"""Drivers run by hand or by make, not by pytest: the chaos suite (``make chaos``) and the stock trainers end to end
(``make e2e-maxtext``, ``make e2e-torchtitan``). Each is ``python -m tests.drivers.NAME``."""
