"""``--job NAMESPACE/JOB``: a malformed one is a one-line error (exit 2) that touches nothing."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("job", ["nojob", "a/b/c", "/j", "ns/"])
def test_gc_refuses_a_malformed_job_before_it_touches_the_root(tmp_path, job):
    root = tmp_path / "root"
    done = subprocess.run([sys.executable, "-m", "replicator.cli", "gc", "--root", str(root), "--ramdisk-backend", "dir", "--job", job],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == f"--job {job!r} must be NAMESPACE/JOB"
    assert not os.path.exists(root)
