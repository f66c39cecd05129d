"""The in-flight gauges of a job: a transfer counts while it runs and is taken back when it ends,
whatever its outcome; transfers of the same job add up."""

import pytest
from prometheus_client import REGISTRY

from replicator.local_tier.in_flight import InFlight

FLIGHT = InFlight("mtc_test_transfer", "moved", "test transfers")


def values(job: str) -> tuple[float | None, float | None]:
    labels = {"training_namespace": "ns", "training_job": job}
    return (
        REGISTRY.get_sample_value("mtc_test_transfer_in_flight_planned_bytes", labels),
        REGISTRY.get_sample_value("mtc_test_transfer_in_flight_moved_bytes", labels),
    )


def test_transfers_count_while_they_run_and_add_up():
    with FLIGHT.transfer("ns", "a", 100) as moved:
        moved(30)
        with FLIGHT.transfer("ns", "a", 50) as other:
            other(50)
            assert values("a") == (150, 80)
        moved(70)
        assert values("a") == (100, 100)
    assert values("a") == (0, 0)


def test_a_failed_transfer_is_taken_back():
    with pytest.raises(OSError), FLIGHT.transfer("ns", "b", 100) as moved:
        moved(40)
        raise OSError("peer gone")
    assert values("b") == (0, 0)


def test_seeded_series_exist_at_zero_until_forgotten():
    FLIGHT.seed("ns", "c")
    assert values("c") == (0, 0)
    FLIGHT.forget("ns", "c")
    assert values("c") == (None, None)
    FLIGHT.forget("ns", "c")  # twice: nothing to remove, no error
