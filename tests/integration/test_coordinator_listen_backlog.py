"""The coordinator listens with a backlog of ``process_tuning.LISTEN_BACKLOG``, not aiohttp's 128: a restarted
coordinator's agents all connect again within seconds, and at 10,000 nodes a queue of 128 dropped about 950
connections a second, each client sending its SYN again 1, 3, then 7 s later (``coordinator_scale --scenarios
restart``)."""

import subprocess

import pytest

from examples.local_cluster import CoordinatorProcess
from replicator.coordinator.api.process_tuning import LISTEN_BACKLOG
from tests.helpers.ports import listen_address

_AIOHTTP_DEFAULT = 128


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn", encoding="ascii") as f:
        return int(f.read())


def test_the_coordinator_listens_with_room_for_a_restarts_reconnections(tmp_path):
    somaxconn = _somaxconn()
    if somaxconn <= _AIOHTTP_DEFAULT:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: the kernel caps any backlog at aiohttp's default")
    coordinator = CoordinatorProcess(str(tmp_path), listen_address(), ["--insecure"]).start()
    try:
        port = coordinator.listen.rpartition(":")[2]
        listing = subprocess.run(
            ["ss", "-H", "-l", "-t", "-n", "sport", "=", f":{port}"], capture_output=True, text=True, check=True
        ).stdout
    finally:
        coordinator.stop()
    (socket_line,) = listing.splitlines()
    # A listening socket's Send-Q is its backlog, as the kernel capped it.
    assert int(socket_line.split()[2]) == min(LISTEN_BACKLOG, somaxconn)
