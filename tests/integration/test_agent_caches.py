"""The node agent's caches in a real agent process: a step committed into a quiet client dir is
checksummed within a second (the unit tests of ``csi_driver.file_cache``: tests/unit/test_agent_caches.py)."""

import os
import time

from csi_driver import file_cache, kubelet
from tests.helpers.agents import start_fresh
from tests.helpers.polling import wait_until
from tests.helpers.steps import commit_step
from tests.helpers.tools import requires_root


@requires_root
def test_an_agent_checksums_a_step_committed_into_a_quiet_dir_within_a_second(start_cluster, tmp_path):
    cluster = start_cluster(nodes=1, peer_tier=False)
    agent = cluster.agents[0]
    target = tmp_path / "pods" / "quick" / "mount"
    kubelet.publish(agent.endpoint, str(target), "quick-slice-0-0-a", attributes={"nodes": "1", "size": "16Mi"})
    start_fresh([target], "quick", nodes=1, take_markers=True, backup_interval_steps=1)
    manifests = os.path.join(agent.ramdisk("quick-slice"), "mtc", "manifests")
    commit_step(target, 1, {"_CHECKPOINT_METADATA": b"{}", "state/data": os.urandom(4096)})
    wait_until(lambda: os.path.exists(os.path.join(manifests, "1.json")), 20, "step 1 checksummed")
    time.sleep(2 * file_cache.RACY_SECONDS)  # every cache of the job is settled and served
    commit_step(target, 2, {"_CHECKPOINT_METADATA": b"{}", "state/data": os.urandom(4096)})
    committed = time.monotonic()
    wait_until(lambda: os.path.exists(os.path.join(manifests, "2.json")), 5, "step 2 checksummed", interval=0.05)
    assert time.monotonic() - committed < 1.0
