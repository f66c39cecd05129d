"""What a test needs from the machine: the Go tools ``make tools`` builds, and root for tmpfs mounts."""

import os
import shutil

import pytest

from examples.local_cluster import can_mount_tmpfs
from tests.helpers import REPO

requires_root = pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting tmpfs needs root")


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else the one ``make tools`` puts in ``.tools/bin``; None if neither."""
    local = os.path.join(REPO, ".tools", "bin", name)
    return shutil.which(name) or (local if os.access(local, os.X_OK) else None)


def require_tool(name: str) -> str:
    """The path of a Go tool ``make tools`` installs; fails the test when it is missing."""
    binary = find_tool(name)
    if binary is None:
        pytest.fail(f"{name} is neither on PATH nor in .tools/bin; run `make tools`")
    return binary
