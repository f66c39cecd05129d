"""Every layer's fixtures come from ``tests/helpers/fixtures.py``; each test is marked with its layer,
the directory it lives in (``pytest -m unit``: the fast layer, no processes and no mounts)."""

from pathlib import Path

import pytest

pytest_plugins = ["tests.helpers.fixtures"]

LAYERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        layer = item.path.relative_to(tests).parts[0]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
