"""The job's half of the pytorch.distributed protocol (mtc_torch.protocol) against a fake agent's files."""

import logging
import os
import threading
import time

import pytest
import yaml

from mtc_torch import protocol
from mtc_torch.protocol import NodeTopology, ProtocolError, ReplicatorConfig, ReplicatorFailed, Waits
from tests.helpers.torch_agent import FakeTorchAgent

FAST = Waits(consumed_s=5, prerestore_s=5, marker_s=5, poll_s=0.01)
SHORT = Waits(consumed_s=0.3, prerestore_s=0.3, marker_s=0.3, poll_s=0.01)
CONFIG = ReplicatorConfig(job_name="llama", node_rank=1, nodes=4, backup_interval_steps=6, workers_per_node=2)


def test_fresh_start_writes_resiliency_keys_and_leaves_the_step0_marker(tmp_path):
    with FakeTorchAgent(tmp_path, "llama", node=1) as agent:
        result = protocol.handshake(tmp_path, CONFIG, FAST)
    assert (result.step, result.directory) == (None, None)
    assert agent.config == {
        "job-name": "llama",
        "framework": "pytorch.distributed",
        "node-rank": 1,
        "nodes": 4,
        "peers-per-node": 1,
        "backup-interval-steps": 6,
        "workers-per-node": 2,
    }
    assert (tmp_path / "llama-s0-n1-w0.restore").is_file()
    assert not (tmp_path / "replicator.yaml").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_resiliency_key_order_and_minutes():
    config = ReplicatorConfig(
        job_name="j", node_rank=0, nodes=2, peers_per_node=1, backup_interval_minutes=30, peer_ranks=(1,)
    )
    assert config.to_yaml() == (
        "job-name: j\nframework: pytorch.distributed\nnode-rank: 0\nnodes: 2\n"
        "peers-per-node: 1\nbackup-interval-minutes: 30\npeer-ranks:\n- 1\n"
    )


def test_restore_renames_the_marker_symlink_to_step_dir(tmp_path):
    (tmp_path / ".staged-7" / "rank-0-of-2").mkdir(parents=True)
    with FakeTorchAgent(tmp_path, "llama", node=1, restore_step=7, staged=".staged-7"):
        result = protocol.handshake(tmp_path, CONFIG, FAST)
    assert result.step == 7
    assert result.directory == tmp_path / "step=7"
    assert os.readlink(tmp_path / "step=7") == ".staged-7"
    assert (result.directory / "rank-0-of-2").is_dir()
    assert not (tmp_path / "llama-s7-n1-w0.restore").exists()


def test_failed_file_raises_with_its_text_and_is_removed(tmp_path):
    with FakeTorchAgent(tmp_path, "llama", node=1, failed="node rank 1 != JobSet index 3"):
        with pytest.raises(ReplicatorFailed, match="node rank 1 != JobSet index 3"):
            protocol.handshake(tmp_path, CONFIG, FAST)
    assert not (tmp_path / "replicator.failed").exists()


def test_a_failed_file_of_an_earlier_container_is_not_read_before_our_yaml_is_written(tmp_path):
    (tmp_path / "replicator.yaml").write_text("old")
    (tmp_path / "replicator.failed").write_text("old failure")
    with pytest.raises(TimeoutError, match="earlier replicator.yaml was not consumed"):
        protocol.handshake(tmp_path, CONFIG, SHORT)
    assert (tmp_path / "replicator.failed").read_text() == "old failure"


def test_errors_file_is_logged_and_deleted(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="mtc_torch.protocol")
    with FakeTorchAgent(tmp_path, "llama", node=1, errors="peer 2 unreachable"):
        protocol.handshake(tmp_path, CONFIG, FAST)
    assert "peer 2 unreachable" in caplog.text
    assert not (tmp_path / "replicator.errors").exists()


def test_stale_tmp_steps_are_removed_but_not_symlinks_or_committed_steps(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    local = tmp_path / "local"
    (local / "5.tmp" / "rank-0-of-2").mkdir(parents=True)
    (local / "5.tmp" / "rank-0-of-2" / ".metadata").write_text("m")
    os.symlink(outside / "keep", local / "5.tmp" / "link")
    os.symlink(outside, local / "6.tmp")
    (local / "4" / "rank-0-of-2").mkdir(parents=True)
    (local / "x.tmp").mkdir()
    with FakeTorchAgent(local, "llama", node=1):
        protocol.handshake(local, CONFIG, FAST)
    names = sorted(p.name for p in local.iterdir())
    assert "5.tmp" not in names
    assert {"6.tmp", "4", "x.tmp"} <= set(names)
    assert (outside / "keep").read_text() == "x"


def test_each_timeout_names_what_was_missing(tmp_path):
    with pytest.raises(TimeoutError, match="did not consume replicator.yaml"):
        protocol.handshake(tmp_path, CONFIG, SHORT)
    os.unlink(tmp_path / "replicator.yaml")

    def consume_only():
        while not (tmp_path / "replicator.yaml").exists():
            time.sleep(0.01)
        os.unlink(tmp_path / "replicator.yaml")

    thread = threading.Thread(target=consume_only)
    thread.start()
    with pytest.raises(TimeoutError, match="no replicator.prerestore"):
        protocol.handshake(tmp_path, CONFIG, SHORT)
    thread.join()
    (tmp_path / "replicator.prerestore").write_text("{}")
    (tmp_path / "llama-s0-n2-w0.restore").touch()  # another node's marker is not ours
    thread = threading.Thread(target=consume_only)
    thread.start()
    with pytest.raises(TimeoutError, match=r"no restore marker <job>-s<step>-n1-w<worker>\.restore"):
        protocol.handshake(tmp_path, CONFIG, SHORT)
    thread.join()


@pytest.mark.parametrize(
    "text, step", [("{}", 0), ("", 0), ("restore-step: 12\n", 12), ("restore-step: 0", 0), ("other: 1", 0)]
)
def test_prerestore_steps(text, step):
    assert protocol.parse_prerestore(text) == step


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2]",
        "restore-step: -1",
        "restore-step: x",
        "restore-step: true",
        "restore-step: 1.5",
        "a: [",
        "!!python/object:os.system {}",
    ],
)
def test_malformed_prerestore_is_a_protocol_error(text):
    with pytest.raises(ProtocolError, match="replicator.prerestore"):
        protocol.parse_prerestore(text)


def test_markers_of_the_wrong_kind_are_refused(tmp_path):
    (tmp_path / "staged").mkdir()
    with protocol.open_dir(tmp_path) as fd:
        os.symlink("staged", tmp_path / "j-s0-n0-w0.restore")
        with pytest.raises(ProtocolError, match="step-0 marker"):
            protocol.claim_marker(fd, tmp_path, "j-s0-n0-w0.restore", 0)
        (tmp_path / "j-s3-n0-w0.restore").touch()
        with pytest.raises(ProtocolError, match="not a symlink"):
            protocol.claim_marker(fd, tmp_path, "j-s3-n0-w0.restore", 3)
        os.symlink("missing", tmp_path / "j-s4-n0-w0.restore")
        with pytest.raises(ProtocolError, match="does not point to a directory"):
            protocol.claim_marker(fd, tmp_path, "j-s4-n0-w0.restore", 4)
        assert not (tmp_path / "step=3").exists() and not (tmp_path / "step=4").exists()


def test_marker_names_are_matched_strictly(tmp_path):
    for name in [
        "j-s5-n0-w0.restore.tmp",
        "j-s5-n0-w0.restorex",
        "j-s-1-n0-w0.restore",
        "../j-s5-n0-w0",
        "j-s5-n00-w0.restore.bak",
        "j-s99999999999999999999-n0-w0.restore",
        "j-s6-n1-w0.restore",
    ]:
        if "/" not in name:
            (tmp_path / name).touch()
    (tmp_path / "j-slice-s2-n0-w0.restore").touch()  # the agent names it after the volume's job key
    with protocol.open_dir(tmp_path) as fd:
        assert protocol.find_marker(fd, 0) == ("j-slice-s2-n0-w0.restore", 2)


def test_control_files_that_are_symlinks_or_huge_are_not_followed_or_read_whole(tmp_path, caplog):
    secret = tmp_path / "secret"
    secret.write_text("password")
    local = tmp_path / "local"
    local.mkdir()
    os.symlink(secret, local / "replicator.errors")
    with protocol.open_dir(local) as fd:
        with pytest.raises(ProtocolError, match="replicator.errors is not a regular file"):
            protocol.check_agent_files(fd)
        os.unlink(local / "replicator.errors")
        (local / "replicator.errors").write_text("e" * (protocol.MAX_CONTROL_FILE_BYTES * 4))
        assert len(protocol.read_small_file(fd, "replicator.errors")) == protocol.MAX_CONTROL_FILE_BYTES
    link = tmp_path / "link"
    os.symlink(local, link)
    with pytest.raises(OSError):
        with protocol.open_dir(link):
            pass


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"NODE_RANK": "1", "NNODES": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2, 1, 2)),
        ({"GROUP_RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, (3, 4, 0, 2)),
        (
            {"NODE_RANK": "0", "GROUP_RANK": "5", "NNODES": "2", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "2"},
            (0, 2, 0, 2),
        ),
    ],
)
def test_topology_from_torchrun_env(env, expected):
    topo = NodeTopology.from_env(env)
    assert (topo.node_rank, topo.nodes, topo.local_rank, topo.local_world_size) == expected


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2"}, "neither NODE_RANK nor GROUP_RANK"),
        ({"NODE_RANK": "2", "NNODES": "2"}, "not in range"),
        ({"NODE_RANK": "x", "NNODES": "2"}, "NODE_RANK='x' is not an integer"),
        ({"NODE_RANK": "0", "NNODES": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2"),
    ],
)
def test_bad_topology_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        NodeTopology.from_env(env)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backup_interval_minutes": 30, "backup_interval_steps": 5}, "exactly one"),
        ({}, "exactly one"),
        ({"backup_interval_steps": 5, "assume_data_parallelism": 3}, "must divide nodes=4"),
        ({"backup_interval_steps": 5, "job_name": "../x"}, "job name"),
        ({"backup_interval_steps": 5, "peer_ranks": (4,)}, "peer_ranks"),
    ],
)
def test_bad_config_is_refused(kwargs, message):
    args = {"job_name": "j", "node_rank": 0, "nodes": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        ReplicatorConfig(**args)


def test_config_round_trips_through_safe_load():
    assert yaml.safe_load(CONFIG.to_yaml())["workers-per-node"] == 2


def test_step_layout_names():
    assert (
        protocol.tmp_step_name(12),
        protocol.step_name(12),
        protocol.rank_dir_name(1, 2),
        protocol.restored_step_name(12),
    ) == ("12.tmp", "12", "rank-1-of-2", "step=12")
    with pytest.raises(ValueError):
        protocol.rank_dir_name(2, 2)
    with pytest.raises(ValueError):
        protocol.step_name(-1)
