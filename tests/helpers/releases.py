"""An earlier release's source tree, to run its coordinator or node agents beside this tree's
(``NodeAgentProcess.source``, ``CoordinatorProcess.source``) in the same virtual environment, and the restarts
that switch a cluster's processes from one tree to the other."""

import dataclasses
import glob
import os
import shutil
import subprocess

import pytest

from examples.local_cluster import CoordinatorProcess, LocalCluster, NodeAgentProcess
from tests.helpers import REPO

# The release before this one, as the commit it was cut from (release 0.2.0: version 0.2.0 and its CHANGELOG).
PREVIOUS_RELEASE = ("0.2.0", "b7cfb62")


def release_tree(commit: str, dest: str) -> str:
    """Extracts the tree of ``commit`` into ``dest`` with ``git archive``, plus this checkout's
    generated gRPC stubs (``protos/*_pb2*.py``, committed since 0.3.0, not in the git of 0.2.0 and before; the CSI
    protos are the same); returns ``dest``.

    Fails the test (never skips: CI clones the whole history) when git or the commit is missing.
    """
    git = shutil.which("git")
    if git is None:
        pytest.fail("git is not on PATH: the cross-release test extracts the previous release with `git archive`")
    found = subprocess.run(
        [git, "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, text=True
    )
    if found.returncode != 0:
        pytest.fail(
            f"commit {commit} (the previous release) is not in the history of {REPO}: clone the whole repository (no --depth), "
            f"or `git fetch --unshallow`; git said: {found.stderr.strip() or found.returncode}"
        )
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.Popen([git, "-C", str(REPO), "archive", "--format=tar", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        pytest.fail(f"git archive {commit} failed with {archive.returncode}")
    stubs = glob.glob(os.path.join(REPO, "protos", "*_pb2*.py"))
    if not stubs:
        pytest.fail(f"no generated stubs in {REPO}/protos: run `make stubs`")
    for stub in stubs:
        shutil.copy(stub, os.path.join(dest, "protos"))
    return dest


def restart_node(cluster: LocalCluster, index: int, source: str | None = None) -> NodeAgentProcess:
    """Replaces node ``index``'s agent by one with the same root, address and flags, running from the
    source tree ``source`` or this one: what a DaemonSet's rolling update does (the ramdisks outlive it)."""
    cluster.agents[index].stop()
    cluster.agents[index] = dataclasses.replace(cluster.agents[index], source=source, process=None)
    return cluster.agents[index].start()


def restart_coordinator(cluster: LocalCluster, source: str | None = None) -> CoordinatorProcess:
    """Replaces the coordinator by one with the same address, state and flags, running from the source
    tree ``source`` or this one (an upgrade or a rollback of its Deployment)."""
    cluster.coordinator.stop()
    cluster.coordinator = dataclasses.replace(cluster.coordinator, source=source, process=None)
    return cluster.coordinator.start()
