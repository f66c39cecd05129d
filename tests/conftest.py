"""Every layer's fixtures come from ``tests/helpers/fixtures.py``; each test is marked with its layer,
the directory it lives in (``pytest -m unit``: the fast layer, no processes and no mounts)."""

from pathlib import Path

import pytest

pytest_plugins = ["tests.helpers.fixtures"]

LAYERS = ("unit", "integration", "e2e", "k8s")
K8S = Path(__file__).resolve().parent / "k8s"
"""A real Kubernetes control plane (``make e2e-k8s``): collected only when named, as in ``pytest tests/k8s``."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.resolve() != K8S:
        return None
    named = (Path(arg.split("::")[0]).resolve() for arg in config.args)
    return not any(path == K8S or K8S in path.parents for path in named) or None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        layer = item.path.relative_to(tests).parts[0]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
