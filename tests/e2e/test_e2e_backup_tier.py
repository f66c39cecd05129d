"""The backup tier end to end, real node agents and real Orbax processes against each real object
store: google-cloud-storage with fake-gcs-server (``gs://``), boto3 with MinIO (``s3://``)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from replicator.local_tier.frameworks.orbax import ERRORS_FILE
from tests.helpers import network
from tests.helpers.agents import scrape
from tests.helpers.jobs import (
    UNTIL_KILLED,
    UNTIL_KILLED_STEPS,
    assert_same_state,
    by_event,
    compared_losses,
    coordinator_recorded,
    kill_past_newest_commit,
    losses,
    recreate,
    replace_node,
    rerun,
    run_job,
    status_of,
    wait_safe_is_newest,
)
from tests.helpers.polling import wait_until
from tests.helpers.tools import requires_root


def backups_settled(cluster, job):
    status = status_of(cluster, job)
    return status["backup_pending"] is None and status["backups"]


def test_whole_cluster_loss_restores_newest_backup_and_never_an_interrupted_one(start_cluster, object_server, tmp_path):
    cluster = start_cluster(backup=object_server.backup_url, env=object_server.env)
    job = run_job(
        "big", list(cluster.agents), tmp_path / "big", [*UNTIL_KILLED, "--dump-dir", str(tmp_path / "dump-1")]
    )
    job.wait(lambda: max(status_of(cluster, job)["backups"] or [0]) >= 12, 180, "a backup of step 12 or later")
    before = kill_past_newest_commit(job)
    wait_until(lambda: backups_settled(cluster, job), 60, "backups settled")
    backed_up = max(status_of(cluster, job)["backups"])
    # What an agent killed mid-upload leaves: a newer step with data and a rank manifest, no COMMIT.
    interrupted = f"mtc/default/{job.job}/steps/{backed_up + 3}"
    object_server.put(f"{interrupted}/rank-0/state/_METADATA", b"partial")
    object_server.put(
        f"{interrupted}/rank-0.manifest.json",
        json.dumps({"step": backed_up + 3, "rank": 0, "files": {}, "incarnation": "gone"}).encode(),
    )

    # Whole-cluster repair: every agent dies with its RAM, the coordinator restarts, fresh nodes join.
    for agent in list(job.agents):
        cluster.lose_node(agent)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    fresh = [cluster.add_node(4 + i, block=f"b{i // 2}") for i in range(4)]
    assert max(before) < UNTIL_KILLED_STEPS, "the job finished before it was killed"
    rerun(job, tmp_path / "dump-2", agents=fresh, steps=backed_up + 24, timeout=240)

    assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [backed_up] * 4
    after = losses(job.pods)
    assert min(after) == backed_up + 1
    compared_losses(before, after)
    for rank in range(4):
        name = f"rank{rank}-step{backed_up}.npz"
        assert_same_state(tmp_path / "dump-1" / name, tmp_path / "dump-2" / name)
    restore = status_of(cluster, job)["restore"]
    assert restore["sources"] == {str(r): "backup:backup" for r in range(4)}
    # The interrupted upload is cleaned up once a newer backup commits.
    wait_until(lambda: not object_server.keys(interrupted + "/"), 90, "interrupted upload cleaned")


def backup_failures(agent) -> float:
    found = re.search(r"^mtc_backup_failures_total (\S+)$", scrape(agent.url), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_storage_outage_does_not_block_training_and_backups_resume(start_cluster, object_server, tmp_path):
    cluster = start_cluster(backup=object_server.backup_url, env=object_server.env)
    job = run_job("steady", list(cluster.agents), tmp_path / "steady", ["--step-sleep", "0.5"])
    job.wait(lambda: status_of(cluster, job)["backups"], 120, "a first backup")
    object_server.server.stop()
    outage_step = max(e["step"] for e in by_event(job.pods[0], "step"))
    # Local and peer tiers carry on: the job keeps saving while storage is down.
    job.wait(
        lambda: max(e["step"] for e in by_event(job.pods[0], "saved")) >= outage_step + 6, 60, "saves during the outage"
    )
    wait_until(lambda: any(backup_failures(agent) > 0 for agent in cluster.agents), 60, "failed backups counted")
    before_return = max(status_of(cluster, job)["backups"])
    object_server.server.start()
    job.wait_done(timeout=180)
    wait_until(lambda: max(status_of(cluster, job)["backups"]) > before_return, 90, "backups resumed")
    assert max(losses(job.pods)) == 30
    # Reported where Orbax reads recoverable errors (it logs them at the job's next start).
    errors = [os.path.join(p.target, ERRORS_FILE) for p in job.pods]
    assert any(os.path.exists(e) and "backup tier" in open(e).read() for e in errors)


def test_restore_from_rolls_back_to_an_older_backup(start_cluster, tmp_path):
    cluster = start_cluster(backup=f"file://{tmp_path / 'objects'}")
    job = run_job(
        "roll", list(cluster.agents), tmp_path / "roll", ["--step-sleep", "0.2", "--dump-dir", str(tmp_path / "dump-1")]
    )
    job.wait(lambda: len(status_of(cluster, job)["backups"]) >= 2, 180, "two backups")
    job.kill_training()
    wait_until(lambda: backups_settled(cluster, job), 60, "backups settled")
    before = status_of(cluster, job)
    older, newest = min(before["backups"]), max(before["backups"])
    assert before["last_backup_step"] == newest and 0 <= before["last_backup_age_seconds"] < 300
    mtc = [
        sys.executable,
        "-m",
        "replicator.cli",
        "restore-from",
        "--coordinator",
        cluster.coordinator.url,
        "--ca",
        cluster.coordinator.ca_file,
        "--token-file",
        cluster.token_file,
        "--job",
        f"default/{job.job}",
    ]
    run = lambda *argv: subprocess.run([*mtc, *argv], capture_output=True, text=True, stdin=subprocess.DEVNULL)  # noqa: E731
    refused = run("--step", "7", "--yes")
    assert refused.returncode == 1 and "HTTP 409" in refused.stderr and "step 7" in refused.stderr
    # The preview names the newer backups it would abandon, and changes nothing; without a terminal, --yes is needed.
    dry = run("--step", str(older), "--dry-run")
    assert dry.returncode == 0 and [
        line
        for line in dry.stdout.splitlines()
        if line.startswith(f"  step {newest}: ") and line.endswith("backup yes")
    ], dry.stdout
    unconfirmed = run("--step", str(older))
    assert unconfirmed.returncode == 2 and "pass --yes" in unconfirmed.stderr

    # A backup of the newest step may still commit after the kill (its completeness reaches the coordinator late), so
    # "unchanged" is: no rollback pending, timeline 0, and every backup seen before still there.
    def unchanged() -> dict:
        now = status_of(cluster, job)
        return {
            **{k: now[k] for k in ("forced_step", "pending_rollback", "timeline")},
            "kept": set(before["backups"]) <= set(now["backups"]),
        }

    assert unchanged() == {"forced_step": None, "pending_rollback": None, "timeline": 0, "kept": True}
    # Requested, then cancelled before the pods return: the job is as before, its backups kept.
    assert run("--step", str(older), "--yes").returncode == 0 and status_of(cluster, job)["pending_rollback"] == older
    cancelled = run("--cancel")
    assert cancelled.returncode == 0 and f"rollback to step {older} is cancelled" in cancelled.stdout
    assert unchanged() == {"forced_step": None, "pending_rollback": None, "timeline": 0, "kept": True}
    assert run("--step", str(older), "--yes").returncode == 0

    rerun(job, tmp_path / "dump-2")
    assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [older] * 4
    for rank in range(4):
        name = f"rank{rank}-step{older}.npz"
        assert_same_state(tmp_path / "dump-1" / name, tmp_path / "dump-2" / name)
    assert status_of(cluster, job)["forced_step"] is None  # the next restore takes the newest step again

    # The rollback began timeline 1: its backups are stored apart, and once one commits, retention
    # deletes the abandoned timeline's backups of the steps after ``older``.
    steps_dir = tmp_path / "objects" / "default" / job.job / "steps"
    committed = lambda: {e for e in os.listdir(steps_dir) if os.path.exists(steps_dir / e / "COMMIT")}  # noqa: E731
    wait_until(
        lambda: any(e.endswith("-t1") for e in committed()) and backups_settled(cluster, job),
        90,
        "a backup of timeline 1",
    )
    assert not [e for e in os.listdir(steps_dir) if "-t" not in e and int(e) > older]
    status = status_of(cluster, job)
    assert (status["timeline"], status["rollbacks"]) == (1, [older])
    assert max(status["backups"]) > older
    late = run("--cancel")  # the rollback was planned and done: nothing to cancel
    assert (
        late.returncode == 1
        and f"HTTP 409: job default/{job.job} has no pending rollback; the last rollback, to step {older}"
        in late.stderr
    )


_STORE_ANSWERS_AFTER = 20.0  # seconds: each request to the store waits half of it each way
_SLOW_STORE_SECONDS = 60.0


@requires_root
def test_a_store_answering_after_20_s_slows_no_save_and_backups_then_complete_and_restore(
    start_cluster, fake_gcs, tmp_path
):
    cluster = start_cluster(backup="gs://ckpt/mtc", env={"STORAGE_EMULATOR_HOST": fake_gcs.url})
    job = run_job(
        "slowstore", list(cluster.agents), tmp_path / "slow", [*UNTIL_KILLED, "--dump-dir", str(tmp_path / "dump-1")]
    )
    job.wait(lambda: status_of(cluster, job)["backups"], 120, "a first backup")

    def newest_saved() -> int:
        return max(set.intersection(*({e["step"] for e in by_event(p, "saved")} for p in job.pods)), default=0)

    probe: list[float] = []

    def ask_store():
        started = time.monotonic()
        with urllib.request.urlopen(fake_gcs.url + "/storage/v1/b/ckpt", timeout=60):
            probe.append(time.monotonic() - started)

    samples = []  # (seconds into the slow store, newest step every rank saved)
    with network.delayed([network.Endpoint("127.0.0.1", fake_gcs.port)], milliseconds=_STORE_ANSWERS_AFTER * 1000 / 2):
        started, asking = time.monotonic(), threading.Thread(target=ask_store)
        asking.start()
        backups_before = set(status_of(cluster, job)["backups"])
        while time.monotonic() - started < _SLOW_STORE_SECONDS:
            samples.append((time.monotonic() - started, newest_saved()))
            for agent in cluster.agents:  # every agent answers, its backups waiting on the store
                with urllib.request.urlopen(agent.url + "/healthz", timeout=5):
                    pass
            time.sleep(3)
        asking.join()
        backups_during = set(status_of(cluster, job)["backups"]) - backups_before
    saved_during = samples[-1][1] - samples[0][1]
    stalls = [later[0] - earlier[0] for earlier, later in zip(samples, samples[1:]) if later[1] == earlier[1]]
    print(
        f"store answered in {probe} s; saves {samples[0][1]} -> {samples[-1][1]} in {samples[-1][0]:.0f} s, "
        f"backups committed meanwhile {sorted(backups_during)}"
    )
    assert probe and probe[0] >= _STORE_ANSWERS_AFTER, probe
    assert saved_during >= 15, samples  # ~0.3 s a step here when unloaded: about 60 steps in 60 s
    assert sum(stalls) < 20, samples  # never 20 s without a new save, in all

    # Once the store answers again, a backup of a step saved after the slow spell commits, and a whole
    # cluster lost restores from it, with the values it had.
    after_slow = newest_saved()
    job.wait(
        lambda: max(status_of(cluster, job)["backups"]) > after_slow, 180, f"a backup newer than step {after_slow}"
    )
    before = kill_past_newest_commit(job)
    wait_until(lambda: backups_settled(cluster, job), 90, "backups settled")
    backed_up = max(status_of(cluster, job)["backups"])
    for agent in list(job.agents):
        cluster.lose_node(agent)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    fresh = [cluster.add_node(4 + i, block=f"b{i // 2}") for i in range(4)]
    rerun(job, tmp_path / "dump-2", agents=fresh, steps=backed_up + 6, timeout=240)
    assert [by_event(p, "restored")[0]["step"] for p in job.pods] == [backed_up] * 4
    assert status_of(cluster, job)["restore"]["sources"] == {str(r): "backup:backup" for r in range(4)}
    compared_losses(before, losses(job.pods))
    for rank in range(4):
        name = f"rank{rank}-step{backed_up}.npz"
        assert_same_state(tmp_path / "dump-1" / name, tmp_path / "dump-2" / name)


_RPO_INTERVAL = 8  # steps between backups


def in_flight_upload(agent) -> tuple[float, float]:
    """(bytes uploaded so far, bytes planned) of the backups running on ``agent``."""
    text = scrape(agent.url)
    found = [
        sum(float(v) for v in re.findall(rf"^mtc_backup_in_flight_{kind}_bytes\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))
        for kind in ("uploaded", "planned")
    ]
    return found[0], found[1]


@requires_root
def test_rpo_a_node_lost_mid_backup_then_the_cluster_30_s_later_restores_within_a_backup_interval_of_safe(
    start_cluster, fake_gcs, tmp_path
):
    cluster = start_cluster(backup="gs://ckpt/mtc", env={"STORAGE_EMULATOR_HOST": fake_gcs.url})
    train = ["--step-sleep", "0.5", "--backup-interval-steps", str(_RPO_INTERVAL), "--ballast-mib", "16"]
    # One slice: no data-parallel peers, so the lost rank is restored from its replica, in the bytes it wrote (a
    # rank restored from a peer's other bytes is not backed up at that step: the next save is).
    job = run_job(
        "rpo",
        list(cluster.agents),
        tmp_path / "rpo",
        [*UNTIL_KILLED, *train, "--dump-dir", str(tmp_path / "d1")],
        slices=1,
    )
    job.wait(lambda: status_of(cluster, job)["backups"], 120, "a first backup")
    first = max(status_of(cluster, job)["backups"])
    lost = job.agents[3]

    # The store slowed down to 8 Mbit/s for all (the 4 ranks' 16 MiB take about a minute): node 3 is lost while it
    # uploads, and the store is fast again from then on.
    with network.rate_limited([network.Endpoint("127.0.0.1", fake_gcs.port)], rate_mbit=8):
        wait_until(
            lambda: (status_of(cluster, job)["backup_pending"] or 0) > first and in_flight_upload(lost)[0] > 0,
            120,
            "node 3 uploading the next backup",
        )
        pending = status_of(cluster, job)["backup_pending"]
        # The trainers die first, and node 3 once a step newer than the backup's is safe (replication is not
        # slowed) and the newest: the fresh node restores it from a replica at once (a copy only node 3 held would
        # be waited for, within its grace).
        wait_until(lambda: status_of(cluster, job)["safe_step"] > pending, 60, f"a step newer than {pending} safe")
        job.kill_training()
        wait_safe_is_newest(cluster, job, 60, "the newest step safe")
        uploaded, planned = in_flight_upload(lost)
        agents = replace_node(cluster, job, 3)
    assert uploaded < planned, (uploaded, planned)  # cut mid-upload
    lost_at = time.monotonic()
    recreate(job, tmp_path / "d1", agents=agents)

    # 30 s after the node loss the whole cluster is lost: what does the backup tier hold then?
    wait_until(lambda: time.monotonic() - lost_at >= 30, 40, "30 s after the node loss")
    status = status_of(cluster, job)
    safe_before, backups = status["safe_step"], status["backups"]
    # Read before the nodes (and their logs) go: the cut backup's rank 3 uploaded by another node, and its COMMIT
    # (retention may delete it again once newer backups commit: the backup keeps 3).
    stand_ins = _backed_up_lines(agents[:3], pending)
    cut_committed = _logged(agents, f": backup of step {pending} complete; ")
    before = losses(job.pods)
    job.kill_training()
    for agent in list(job.agents):
        cluster.lose_node(agent)
    cluster.coordinator.kill()
    cluster.coordinator.start()
    fresh = [cluster.add_node(5 + i, block=f"b{i // 2}") for i in range(4)]
    # What the store holds once every agent is gone (an upload may have committed after the status was read).
    committed = [
        int(blob.name.split("/")[-2].split("-")[0])
        for blob in fake_gcs.client().bucket("ckpt").list_blobs(prefix=f"mtc/default/{job.job}/steps/")
        if blob.name.endswith("/COMMIT")
    ]
    backed_up = max(committed)
    print(f"first backup {first}, cut backup {pending}, safe {safe_before}, listed {backups}, committed {committed}")
    rerun(job, tmp_path / "d2", agents=fresh, steps=backed_up + 4, timeout=240)

    restored = [by_event(p, "restored")[-1]["step"] for p in job.pods]
    assert restored == [backed_up] * 4
    assert status_of(cluster, job)["restore"]["sources"] == {str(r): "backup:backup" for r in range(4)}
    # The stated bound: one backup interval, plus the steps trained while one backup uploads and is confirmed
    # (under a second unshaped here: a step takes 0.5 s or more, so that is within one more interval).
    assert backed_up >= safe_before - 2 * _RPO_INTERVAL, (backed_up, safe_before, pending)
    # The cut backup completed: another node uploaded rank 3's replica in the lost node's place (before, it was given
    # up for a newer step, whose upload then began from nothing; and earlier still, waited for 600 s).
    assert cut_committed, (pending, committed)
    assert stand_ins.get(3, 0) >= 1, stand_ins
    compared_losses(before, losses(job.pods))
    for rank in range(4):
        name = f"rank{rank}-step{backed_up}.npz"
        assert_same_state(tmp_path / "d1" / name, tmp_path / "d2" / name)


def _logged(agents, text: str) -> bool:
    """Whether an agent's log has ``text``."""
    for agent in agents:
        with open(agent.log_path, encoding="utf-8", errors="replace") as log:
            if text in log.read():
                return True
    return False


def _backed_up_lines(agents, step: int) -> dict[int, int]:
    """Rank -> how many times an agent's log says it uploaded the rank's ``step`` (``BackupWorker._upload``)."""
    found: dict[int, int] = {}
    for agent in agents:
        with open(agent.log_path, encoding="utf-8", errors="replace") as log:
            for rank in re.findall(rf": rank (\d+) step {step} backed up to ", log.read()):
                found[int(rank)] = found.get(int(rank), 0) + 1
    return found


def test_a_coordinator_restarted_mid_backup_keeps_its_attempt_and_the_backup_commits_uploaded_once(
    fake_gcs, start_cluster, tmp_path
):
    """Issue 49: the coordinator is SIGKILLed while a backup uploads (the store frozen meanwhile, so it cannot
    finish first) and restarted. It reads the backup in progress from its state dir: it orders the same step under
    the same upload tag, the uploads in flight finish, the step commits, and no rank's step is uploaded twice.
    (``fake_gcs`` is set up first, so the cluster stops before it.)"""
    cluster = start_cluster(backup="gs://ckpt/mtc", env={"STORAGE_EMULATOR_HOST": fake_gcs.url})
    train = ["--backup-interval-steps", "6", "--ballast-mib", "2", "--dump-dir", str(tmp_path / "d1")]
    job = run_job("midbackup", list(cluster.agents), tmp_path / "midbackup", [*UNTIL_KILLED, *train])
    job.wait(lambda: status_of(cluster, job)["backups"], 120, "a first backup")
    steps = tmp_path / "gcs-data" / "ckpt" / "mtc" / "default" / job.job / "steps"
    try:
        for _ in range(5):  # a backup that commits before the store is frozen tests nothing: the next one is taken
            last = max(status_of(cluster, job)["backups"])
            wait_until(lambda: (status_of(cluster, job)["backup_pending"] or 0) > last, 60, "the next backup chosen")
            pending = status_of(cluster, job)["backup_pending"]
            os.kill(fake_gcs.pid, signal.SIGSTOP)
            if pending is not None and not (steps / str(pending) / "COMMIT").exists():
                break
            os.kill(fake_gcs.pid, signal.SIGCONT)
            wait_until(lambda: status_of(cluster, job)["backup_pending"] != pending, 60, f"backup {pending} done")
        else:
            raise AssertionError("harness: five backups committed before the store could be frozen")
        # Harness sync: the state dir holds the backup in progress (written within a tick of the choice).
        kept = coordinator_recorded(cluster.coordinator, lambda jobs: jobs[0]["backup"]["pending"] == pending)
        attempt = kept[0]["backup"]["attempt"]
        cluster.coordinator.kill()
        cluster.coordinator.start()
        wait_until(lambda: status_of(cluster, job)["incarnation"] is not None, 30, "the incarnation adopted")
        assert status_of(cluster, job)["backup_pending"] == pending
    finally:
        os.kill(fake_gcs.pid, signal.SIGCONT)
    job.wait(lambda: pending in status_of(cluster, job)["backups"], 90, f"backup {pending} committed")
    # Every rank's upload carries the tag chosen before the restart, and went once.
    manifests = [json.loads((steps / str(pending) / f"rank-{r}.manifest.json").read_text()) for r in range(4)]
    assert [m["incarnation"] for m in manifests] == [attempt] * 4
    assert _backed_up_lines(cluster.agents, pending) == {r: 1 for r in range(4)}
    job.kill_training()
