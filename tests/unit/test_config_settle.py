"""An unusable ``replicator.yaml`` is refused only once it stayed unchanged for the bound: the Resiliency
library writes it in place, so the agent may read it empty (real files; an injected clock)."""

import pytest

from replicator.local_tier import frameworks
from replicator.local_tier.frameworks import InvalidReplicatorConfig
from replicator.node.handshake import UnsettledConfigs
from replicator.pacing import timing
from replicator.wire.messages import JobRef

TORCH = frameworks.get("pytorch.distributed")
JOB = JobRef("default", "llama")
CONFIG = "job-name: llama\nframework: pytorch.distributed\nnode-rank: 0\nnodes: 1\npeers-per-node: 1\nbackup-interval-minutes: 30\n"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_library_writers_empty_file_is_another_version_than_its_filled_one_and_says_it_is_empty(tmp_path):
    with open(tmp_path / "replicator.yaml", "w") as f:  # as init_high_scale_ckpt: open, then yaml.dump
        empty = TORCH.read_config(str(tmp_path))
        f.write(CONFIG)
    filled = TORCH.read_config(str(tmp_path))
    assert (empty.data, filled.data) == (b"", CONFIG.encode()) and empty.version != filled.version
    with pytest.raises(InvalidReplicatorConfig, match=r"^replicator.yaml field \(document\): the file is empty$"):
        TORCH.parse_config(empty.data.decode(), 0, 1)
    assert TORCH.parse_config(filled.data.decode(), 0, 1).backup_interval_minutes == 30
    assert TORCH.read_config(str(tmp_path)).version == filled.version  # unchanged: the same version


def test_an_unusable_version_settles_after_the_bound_and_any_change_starts_the_wait_again():
    clock = Clock()
    unsettled = UnsettledConfigs(clock=clock)
    assert unsettled.settle_seconds == timing.CONFIG_SETTLE_SECONDS == 5.0
    empty, half = (1, 2, 0, 10, 10), (1, 2, 40, 11, 11)
    assert not unsettled.settled(JOB, empty)
    clock.now += 4.9
    assert not unsettled.settled(JOB, empty)
    clock.now += 0.1
    assert unsettled.settled(JOB, empty)
    assert not unsettled.settled(JOB, half)  # written meanwhile: a new version waits afresh
    clock.now += 4.0
    assert not unsettled.settled(JOB, half) and not unsettled.settled(JobRef("default", "other"), empty)  # per job
    unsettled.forget(JOB)
    clock.now += 4.0
    assert not unsettled.settled(JOB, half)  # forgotten: the wait starts at this read
