"""The client's wheel (``mtc-torch``) installed as into a training image that already has its torch
(``make client-compat``): for each torch of ``MTC_CLIENT_TORCH`` (the oldest the client accepts and the newest
served), a clean venv gets torch, numpy and PyYAML first; ``pip install`` of the wheel must add our package and
change nothing else; then the client tests run their jobs in that venv (``TORCH_VENV``)."""

import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.clean_venv import CleanVenv, artifact

VERSION = tomllib.loads((REPO / "clients" / "torch" / "pyproject.toml").read_text())["project"]["version"]
TORCH_VERSIONS = os.environ.get("MTC_CLIENT_TORCH", "").split()
# The tests whose jobs import mtc_torch under TORCH_VENV's Python (TorchTitan's need torchtitan: make e2e-torchtitan).
CLIENT_TESTS = [
    f"tests/integration/test_torch_{name}.py"
    for name in ("client", "save_path", "step_layout", "mesh_change", "reshard")
]


@pytest.mark.skipif(not TORCH_VERSIONS, reason="MTC_CLIENT_TORCH names no torch version: make client-compat")
@pytest.mark.parametrize("torch_version", TORCH_VERSIONS)
def test_the_client_installs_beside_the_images_torch_changing_nothing_else_and_its_tests_pass(torch_version):
    wheel = artifact(f"mtc_torch-{VERSION}-py3-none-any.whl")
    # Deleted at the end, not kept by pytest's tmp_path: each venv holds a CUDA torch (about 5 GB).
    with tempfile.TemporaryDirectory(prefix=f"mtc-client-torch-{torch_version}-") as root:
        venv = CleanVenv(Path(root) / "venv")
        began = time.monotonic()
        venv.pip_install(f"torch=={torch_version}", "numpy", "PyYAML")
        before = venv.packages()
        installed = time.monotonic()
        venv.pip_install(str(wheel))
        after = venv.packages()
        changed = {name: (before.get(name), v) for name, v in after.items() if before.get(name) != v}
        assert changed == {"mtc-torch": (None, VERSION)}
        assert before.keys() <= after.keys()
        assert after["torch"] == torch_version

        done = venv.run(venv.bin("python"), "-c", "import mtc_torch, torch; print(mtc_torch.__file__)")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().startswith(str(venv.site_packages())), done.stdout

        tested = time.monotonic()
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CLIENT_TESTS],
            cwd=REPO,
            env={**os.environ, "TORCH_VENV": str(venv.path)},
            capture_output=True,
            text=True,
            timeout=1800,
        )
        summary = tests.stdout.strip().splitlines()[-1]
        assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
        assert "skipped" not in summary and "passed" in summary, summary
        print(
            f"torch {torch_version}: torch, numpy and PyYAML installed in {installed - began:.0f} s, the client in"
            f" {tested - installed:.0f} s; the client tests in {time.monotonic() - tested:.0f} s: {summary}"
        )
