"""The fixtures of the real-Kubernetes layer (``make e2e-k8s``), apart from ``tests/helpers/fixtures.py``
so that the other layers (and virtualenvs without lightkube, such as ``make e2e-orbax-oldest``'s) never
import the Kubernetes client."""

import pytest
from lightkube import AsyncClient, KubeConfig

from tests.helpers.kube import Binaries, ControlPlane
from tests.helpers.kube.node import KubeletNode


@pytest.fixture(scope="session")
def control_plane():
    """A real Kubernetes control plane on 127.0.0.1 (etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler, the JobSet controller), shared by the session's tests and stopped after them."""
    try:
        binaries = Binaries.find()
    except FileNotFoundError as missing:
        pytest.fail(str(missing))
    with ControlPlane(binaries) as plane:
        yield plane


@pytest.fixture
def own_control_plane():
    """A control plane of the test's own: stopping its API server disturbs no other test's watches (a restarted
    API server answers watches from old resource versions with "Too large resource version" for a while)."""
    with ControlPlane() as plane:
        yield plane


@pytest.fixture(scope="session")
def kubelet_node(control_plane):
    """A real node on 127.0.0.2 (containerd, runc and a kubelet) in ``control_plane``: busybox images, host network."""
    with KubeletNode(control_plane, "127.0.0.2") as node:
        yield node


@pytest.fixture
async def kube(control_plane):
    """An asyncio client of the shared control plane, as the tests' field manager."""
    client = AsyncClient(KubeConfig.from_file(control_plane.kubeconfig), field_manager="mtc-tests")
    yield client
    await client.close()
