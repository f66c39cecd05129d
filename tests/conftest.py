"""Every layer's fixtures come from ``tests/helpers/fixtures.py``; each test is marked with its layer,
the directory it lives in (``pytest -m unit``: the fast layer, no processes and no mounts)."""

from pathlib import Path

import pytest

pytest_plugins = ["tests.helpers.fixtures"]

LAYERS = ("unit", "integration", "e2e", "k8s", "deploy", "packaging")
NAMED_ONLY = tuple(Path(__file__).resolve().parent / layer for layer in ("k8s", "deploy", "packaging"))
"""A real Kubernetes control plane (``make e2e-k8s``), the product deployed on real kubelets by its chart
(``make e2e-deploy``) and the release's artifacts installed in clean venvs (``make release-check``,
``make client-compat``): collected only when named, as in ``pytest tests/k8s``."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    layer = collection_path.resolve()
    if layer not in NAMED_ONLY:
        return None
    named = (Path(arg.split("::")[0]).resolve() for arg in config.args)
    return not any(path == layer or layer in path.parents for path in named) or None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        layer = item.path.relative_to(tests).parts[0]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
