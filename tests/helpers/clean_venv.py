"""A clean virtualenv (no system site-packages, nothing of this tree on its path) to install the release's
artifacts into as a user would (tests/packaging), and the artifacts ``make release`` leaves in ``dist/``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

DIST = Path(os.environ.get("MTC_DIST", REPO / "dist")).resolve()


def artifact(pattern: str) -> Path:
    """The one file of ``dist/`` matching ``pattern``; fails the test naming the target that makes it."""
    found = sorted(DIST.glob(pattern))
    if len(found) != 1:
        pytest.fail(f"{DIST}/{pattern}: {len(found)} files, not 1: run `make release` (or make client-wheel)")
    return found[0]


class CleanVenv:
    """``python -m venv`` at ``path``, with the Python running the tests (3.11 here). Commands run from ``path``,
    so that ``import`` finds what pip installed, not this repository's packages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return subprocess.run(argv, cwd=self.path, env=env, capture_output=True, text=True, timeout=timeout)

    def pip_install(self, *requirements: str, timeout: float = 900) -> None:
        """``pip install`` with dependencies, from PyPI or pip's cache; fails the test with pip's output."""
        done = self.run(self.bin("python"), "-m", "pip", "install", "-q", *requirements, timeout=timeout)
        assert done.returncode == 0, f"pip install {' '.join(requirements)}:\n{done.stdout}\n{done.stderr}"

    def packages(self) -> dict[str, str]:
        """Every installed distribution (pip's normalized names) and its version."""
        done = self.run(self.bin("python"), "-m", "pip", "list", "--format=json")
        assert done.returncode == 0, done.stderr
        return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(done.stdout)}

    def site_packages(self) -> Path:
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        return Path(self.run(self.bin("python"), "-c", code).stdout.strip())
