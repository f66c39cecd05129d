"""The node's pushes against a real peer service: an order repeated soon after its push succeeded is
checked against the target's manifest, and pushed again at once when the target lost the copy."""

import asyncio
import os

from csi_driver.ramdisk import Ramdisk
from replicator.local_tier.job_keys import BusySteps
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.log_once import LogOnce
from replicator.node.pushes import REPLICATED, Pusher
from replicator.wire.bearer import Tokens
from replicator.wire.messages import JobRef, ReplicateOrder, Target
from tests.helpers.peer import JOB, NS, TOKEN, commit_own_step


async def _carry_out(pusher: Pusher, session, disks, order) -> None:
    pusher.start(session, disks, order)
    await asyncio.gather(*pusher.tasks())


async def test_a_repeated_order_pushes_again_only_when_the_target_lost_the_copy(serve, session, tmp_path):
    source = JobMeta(str(tmp_path / "source"))
    commit_own_step(source, 7, 0, {"a": os.urandom(1 << 20), "d/b": os.urandom(4096)})
    disks = {JobRef(NS, JOB): Ramdisk(NS, JOB, 64 << 20, str(tmp_path / "source"))}
    target = await serve(str(tmp_path / "target"))
    order = ReplicateOrder(NS, JOB, 0, 7, (Target("node-b", target.base_url),))
    pusher = Pusher(Tokens.of(TOKEN), None, BusySteps(), LogOnce(), min_interval_seconds=0.0)
    pushed = REPLICATED.labels("ok")._value.get()

    await _carry_out(pusher, session, disks, order)
    assert set(target.meta.replicas()) == {(0, 7)} and REPLICATED.labels("ok")._value.get() == pushed + 1
    installed = target.meta.replica_installed_at(0, 7)

    # The coordinator had not yet seen the target's report: the same order again, and the copy is there.
    await _carry_out(pusher, session, disks, order)
    assert REPLICATED.labels("ok")._value.get() == pushed + 1 and target.meta.replica_installed_at(0, 7) == installed

    # The target gave the copy up (under pressure, before it learnt the step was the round's): pushed again now.
    target.meta.drop_replica(0, 7)
    await _carry_out(pusher, session, disks, order)
    assert REPLICATED.labels("ok")._value.get() == pushed + 2
    assert target.meta.replicas()[(0, 7)].files == source.manifests()[7].files
