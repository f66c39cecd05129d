"""Read-once restores end to end: a data-parallel Orbax job (2 slices x 2 nodes, DP = 2) loses every
node and restores from the backup tier (fake-gcs-server, whose request log counts the reads). One
node per identical group downloads each unique shard; its peer fetches it from that node. When the
downloading node's agent is SIGKILLed as it starts staging, its peer falls back to the store."""

import glob
import os
import threading

import pytest

from replicator.backup_tier.layout import RankManifest
from tests.helpers import network
from tests.helpers.jobs import (
    UNTIL_KILLED,
    assert_resumed_exactly,
    kill_past_newest_commit,
    recreate,
    run_job,
    status_of,
)
from tests.helpers.polling import wait_until
from tests.helpers.servers import FakeGcsServer
from tests.helpers.tools import require_tool, requires_root

pytestmark = requires_root  # tmpfs ramdisks; the second case shapes loopback traffic


@pytest.fixture
def logged_gcs(tmp_path):
    """fake-gcs-server with bucket ``ckpt`` that logs every request it answers; always stopped."""
    server = FakeGcsServer(
        require_tool("fake-gcs-server"),
        data_dir=str(tmp_path / "gcs-data"),
        request_log=str(tmp_path / "gcs-requests.log"),
    ).start()
    server.client().create_bucket("ckpt")
    yield server
    server.stop()


def backed_up_and_lost(start_cluster, server, tmp_path):
    """Trains the DP = 2 job until a backup exists whose ranks were found identical, kills it, loses
    every node and adds four fresh ones (the coordinator survives). Returns (cluster, job, the
    backed-up step, the killed run's losses, the fresh agents)."""
    cluster = start_cluster(backup="gs://ckpt/mtc", env={"STORAGE_EMULATOR_HOST": server.url})
    # Every save from step 6 is backed up, so the newest complete step is in the store when the nodes are lost: the restore
    # plans it from the backup tier at once. (Were it held only by the lost nodes, the coordinator would plan it
    # from them until they fall silent, then replan an older backup.)
    job = run_job(
        "dp",
        list(cluster.agents),
        tmp_path / "dp",
        [*UNTIL_KILLED, "--backup-interval-steps", "3", "--dump-dir", str(tmp_path / "dump-1")],
    )

    def identical_backup():
        # Past step 6: Orbax also saves step 1, and step 3 is then 2 steps short of the backup interval, so a kill
        # right after step 3 left a newest step never backed up (CI rehearsal, 1 run).
        status = status_of(cluster, job)
        # (Not "no backup pending": while the job saves, the next backup is chosen as the previous one completes.)
        return status["backups"] and max(status["backups"]) >= 6 and len(status["identical_peers"]) == 4

    job.wait(identical_backup, 180, "a backup of a step whose DP peers were found identical")
    before = kill_past_newest_commit(job)

    def newest_backed_up():
        status = status_of(cluster, job)
        return status["backup_pending"] is None and max(status["backups"]) == status["newest_complete_step"]

    wait_until(newest_backed_up, 60, "the newest complete step backed up")
    step = max(status_of(cluster, job)["backups"])
    lost = list(job.agents)
    for agent in lost:
        cluster.lose_node(agent)
    # Replacement nodes join after the node timeout, as on a real cluster: the lost ones are silent by then.
    wait_until(lambda: len(status_of(cluster, job)["silent_nodes"]) == len(lost), 30, "the lost nodes silent")
    fresh = [cluster.add_node(4 + i, block=f"b{i // 2}") for i in range(4)]
    return cluster, job, step, before, fresh


def shard_reads(server, job, step) -> dict[str, int]:
    """Object -> times the store served it, for the step's shards (not its manifests or COMMIT)."""
    prefix = f"mtc/default/{job.job}/steps/{step}/"
    return {name: n for name, n in server.object_reads("ckpt", prefix + "rank-").items() if "/" in name[len(prefix) :]}


def objects_of(server, job, step, rank) -> set[str]:
    prefix = f"mtc/default/{job.job}/steps/{step}/"
    manifest = RankManifest.from_json(
        server.client().bucket("ckpt").blob(f"{prefix}rank-{rank}.manifest.json").download_as_text()
    )
    return {prefix + f.object for f in manifest.files.values() if f.size}


def test_a_data_parallel_restore_after_cluster_loss_reads_each_unique_shard_once(start_cluster, logged_gcs, tmp_path):
    cluster, job, step, before, fresh = backed_up_and_lost(start_cluster, logged_gcs, tmp_path)
    recreate(job, tmp_path / "dump-2", agents=fresh, steps=step + 6)
    job.wait_done(timeout=240)

    assert_resumed_exactly(job, step, before, tmp_path)
    sources = status_of(cluster, job)["restore"]["sources"]
    node_of = {place["rank"]: place["node"] for place in status_of(cluster, job)["ranks"]}
    # Ranks 0 and 1 (the lowest of each identical group) download; 2 and 3 fetch from their nodes.
    assert sources["0"] == sources["1"] == "backup:backup"
    assert sources["2"].endswith(f":{node_of[0]}") and sources["3"].endswith(f":{node_of[1]}"), sources
    reads = shard_reads(logged_gcs, job, step)
    assert reads and set(reads.values()) == {1}, reads  # each shard served once
    assert set(reads) == objects_of(logged_gcs, job, step, 0) | objects_of(logged_gcs, job, step, 1)


def test_a_downloader_killed_as_it_stages_leaves_its_peer_to_read_the_store(start_cluster, logged_gcs, tmp_path):
    cluster, job, step, before, fresh = backed_up_and_lost(start_cluster, logged_gcs, tmp_path)
    killed = []

    def kill_first_downloader():
        # Once the store serves the step's first shard, a downloader (rank 0 or 1) has started; the
        # one whose ramdisk has an incoming directory then is staging: SIGKILL its agent.
        wait_until(lambda: shard_reads(logged_gcs, job, step), 200, "the first shard read", interval=0.01)
        node_of = {place["rank"]: place["node"] for place in status_of(cluster, job)["ranks"]}
        downloaders = [a for a in fresh if a.node_id in (node_of[0], node_of[1])]

        def staging():
            return [a for a in downloaders if glob.glob(os.path.join(a.ramdisk(job.job), "mtc", "incoming", "*"))]

        wait_until(staging, 30, "a downloader staging", interval=0.005)
        agent = staging()[0]
        agent.kill()
        killed.append(agent)

    watcher = threading.Thread(target=kill_first_downloader)
    # A slow store: the downloads take seconds, so the kill lands while one is in flight.
    with network.rate_limited([network.Endpoint("127.0.0.1", logged_gcs.port)], rate_mbit=0.5):
        watcher.start()
        recreate(job, tmp_path / "dump-2", agents=fresh, steps=step + 6)
        watcher.join(timeout=240)
        assert killed, "harness: no downloader was seen staging"
        node_of = {place["rank"]: place["node"] for place in status_of(cluster, job)["ranks"]}
        lost_rank = next(rank for rank, node in node_of.items() if node == killed[0].node_id)
        assert lost_rank in (0, 1)
        peer = lost_rank + 2
        wait_until(
            lambda: str(peer) in (status_of(cluster, job)["restore"]["sources"] or {}),
            120,
            "the peer staged from the store",
        )
    killed[0].start()  # the DaemonSet restarts the agent: its own rank's restore resumes
    job.wait_done(timeout=240)

    assert_resumed_exactly(job, step, before, tmp_path)
    sources = status_of(cluster, job)["restore"]["sources"]
    assert sources[str(peer)] == "backup:backup"  # fell back to the store
    other = 1 - lost_rank
    assert sources[str(other + 2)].endswith(f":{node_of[other]}")  # the other group still fanned out
