"""The coordinator raises its soft open-file limit to the hard one: each node holds one or two connections."""

import resource

import pytest

from replicator.coordinator.api.process_tuning import raise_open_file_limit


@pytest.fixture
def low_soft_limit():
    """The soft limit at 256, as a low container default would leave it; restored afterwards."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    if before[1] != resource.RLIM_INFINITY and before[1] <= 256:
        pytest.skip(f"the hard limit here ({before[1]}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, before[1]))
    yield before[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_coordinator_raises_its_soft_open_file_limit_to_the_hard_one(low_soft_limit):
    hard = low_soft_limit
    assert raise_open_file_limit() == hard
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
