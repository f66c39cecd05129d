"""The backup store checked at the agent's start (``backup_tier.probe``, ``node.store_check``): against real stores
(``file://``, fake-gcs-server, MinIO), and in a real ``mtc node`` process whose store is good or has no bucket."""

import json
import time
import urllib.request

import pytest

from examples.local_cluster import NodeAgentProcess, unmount_all_below
from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.probe import PROBE_PREFIX, probe_store
from tests.helpers.agents import scrape
from tests.helpers.ports import listen_address


def test_probe_passes_on_file_store_and_leaves_nothing(tmp_path):
    store = open_backup_store(f"file://{tmp_path}/store")
    result = probe_store(store.objects, "node-a")
    assert result.usable, result.error
    assert result.url == f"file://{tmp_path}/store"
    assert store.objects.list("", recursive=True) == []


def test_probe_names_the_failed_write_on_a_file_in_place_of_the_store(tmp_path):
    (tmp_path / "store").write_text("not a directory")
    result = probe_store(open_backup_store(f"file://{tmp_path}/store").objects, "node-a")
    assert not result.usable
    assert result.error.startswith("upload failed: ")
    assert "Not a directory" in result.error
    assert "\n" not in result.error


def test_probe_on_fake_gcs_passes_with_the_bucket_and_fails_without(fake_gcs):
    good = open_backup_store("gs://ckpt/mtc", emulator_host=fake_gcs.url).objects
    result = probe_store(good, "node-a")
    assert result.usable, result.error
    assert [b.name for b in fake_gcs.client().bucket("ckpt").list_blobs()] == []
    bad = probe_store(open_backup_store("gs://no-such-bucket/mtc", emulator_host=fake_gcs.url).objects, "node-a")
    assert not bad.usable
    assert bad.error.startswith("upload failed: ")
    assert "no-such-bucket" in bad.error


def test_probe_on_minio_passes_with_the_bucket_and_fails_without(minio, monkeypatch):
    for key, value in minio.client_env().items():
        monkeypatch.setenv(key, value)
    good = open_backup_store("s3://ckpt/mtc", s3_endpoint_url=minio.url).objects
    result = probe_store(good, "node-a")
    assert result.usable, result.error
    assert minio.client().list_objects_v2(Bucket="ckpt").get("Contents", []) == []
    bad = probe_store(open_backup_store("s3://no-such-bucket/mtc", s3_endpoint_url=minio.url).objects, "node-a")
    assert not bad.usable
    assert "NoSuchBucket" in bad.error or "does not exist" in bad.error
    # The error names the object below the store's URL once: s3://no-such-bucket/mtc/.mtc-probe-..., not mtc/mtc/.
    assert "s3://no-such-bucket/mtc/.mtc-probe-" in bad.error and "/mtc/mtc/" not in bad.error, bad.error


@pytest.fixture
def agent_with_store(tmp_path):
    """Factory: ``agent_with_store(backup_url, env)`` -> a ready ``mtc node`` (dir ramdisks), always stopped."""
    agents: list[NodeAgentProcess] = []

    def start(backup: str, env: dict[str, str]) -> NodeAgentProcess:
        workdir = str(tmp_path / f"agent-{len(agents)}")
        agent = NodeAgentProcess("node-a", workdir, listen_address(), "dir", ["--backup", backup], env)
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        agent.stop()
    unmount_all_below(str(tmp_path))


def _health(agent: NodeAgentProcess) -> tuple[int, dict]:
    with urllib.request.urlopen(f"{agent.url}/healthz", timeout=5) as response:
        return response.status, json.loads(response.read())


def _wait_checked(agent: NodeAgentProcess, timeout: float) -> tuple[float, dict]:
    """Seconds from now until ``/healthz`` shows the probe's verdict, and that body."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        status, body = _health(agent)
        assert status == 200, body  # a store fault never fails the agent's health
        if body["backup_store"] != "unchecked":
            return time.monotonic() - started, body
        time.sleep(0.05)
    raise AssertionError(f"no probe verdict within {timeout} s: {agent.tail_log()}")


def test_agent_with_a_good_store_reports_it_usable_and_logs_no_error(agent_with_store, fake_gcs):
    agent = agent_with_store("gs://ckpt/mtc", {"STORAGE_EMULATOR_HOST": fake_gcs.url})
    _, body = _wait_checked(agent, timeout=10)
    assert body["backup_store"] == "ok"
    assert 'mtc_backup_store_usable{store="gs://ckpt/mtc"} 1.0' in scrape(agent.url)
    assert "ERROR" not in agent.tail_log(200)
    assert not [b.name for b in fake_gcs.client().bucket("ckpt").list_blobs(prefix="mtc/" + PROBE_PREFIX)]


def test_agent_with_no_bucket_logs_one_error_within_seconds_and_keeps_serving(agent_with_store, fake_gcs):
    agent = agent_with_store("gs://no-such-bucket/mtc", {"STORAGE_EMULATOR_HOST": fake_gcs.url})
    seconds, body = _wait_checked(agent, timeout=10)
    assert seconds < 5
    assert body["backup_store"].startswith("unusable: upload failed: ")
    assert 'mtc_backup_store_usable{store="gs://no-such-bucket/mtc"} 0.0' in scrape(agent.url)
    errors = [line for line in agent.tail_log(200).splitlines() if "backup store" in line and "ERROR" in line]
    assert len(errors) == 1, agent.tail_log(200)
    assert "gs://no-such-bucket/mtc unusable: upload failed: " in errors[0]
    assert agent.process.poll() is None
