"""What ``make e2e-torchtitan`` gives the stock TorchTitan trainer on CPU: the CPU-only shim
(``sitecustomize.py``, on the trainers' ``PYTHONPATH``) and its offline assets (``assets.py``)."""
