"""The deployment suite's cluster (``make e2e-deploy``): a control plane, two real kubelet nodes with a pod network,
kube-proxy and CoreDNS, in the network namespace the Makefile gives the suite; and the README's quick start run on
it, once, for every test of the session (they are steps of one user's first hour, in order)."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.kube import ControlPlane
from tests.helpers.kube.deploy_node import DeployNode
from tests.helpers.kube.deployment import IMAGES, Deployment
from tests.helpers.kube.pod_network import API_ADDRESS, ClusterServices, node_address, pod_cidr, set_up_network

AUDITED = ("system:serviceaccounts:mtc-system",)
"""The chart's ServiceAccounts, whose every request the API server logs (``test_wrap_up.py``: RBAC, exactly)."""
NODE_START_SECONDS = 300.0  # the images (about 1.5 GB) are imported into each node's containerd
DISK_NEEDED_BYTES = 6 << 30
"""Free space the suite needs where its nodes keep their files: three nodes' containerd (the images, then each
container's writable layer) and the control plane's took about 4 GiB at their peak (2026-11-27, 2 cores)."""


@pytest.fixture(scope="session")
def deployment():
    images = Path(os.environ.get("MTC_DEPLOY_IMAGES", REPO / "build" / "deploy"))
    archives = [images / f"{name}.tar" for name in IMAGES]
    if missing := [str(a) for a in archives if not a.is_file()]:
        pytest.fail(f"{', '.join(missing)} missing: run `make e2e-deploy`, which builds them")
    scratch = tempfile.gettempdir()
    if (free := shutil.disk_usage(scratch).free) < DISK_NEEDED_BYTES:
        pytest.fail(
            f"{scratch} has {free >> 20} MiB free; the deployment suite's nodes need about {DISK_NEEDED_BYTES >> 20} "
            "MiB there (a full disk leaves pods Pending: containerd cannot create their containers)"
        )
    try:
        set_up_network()
    except RuntimeError as refused:
        pytest.fail(str(refused))
    with ControlPlane(address=API_ADDRESS, audited=AUDITED) as plane, contextlib.ExitStack() as stack:
        nodes = [DeployNode(plane, node_address(i), pod_cidr(i), archives) for i in range(2)]
        cluster = Deployment(plane, nodes, archives)
        stack.callback(cluster.stop_nodes)  # the nodes the tests added and lost too
        for node in nodes:
            node.start(timeout_seconds=NODE_START_SECONDS)
        stack.enter_context(ClusterServices(plane, nodes[0].name))
        cluster.installed = cluster.run_quick_start()
        yield cluster
