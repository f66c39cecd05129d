"""The ``pytorch.distributed`` file protocol: replicator.yaml as the Resiliency library writes it,
prerestore and markers as it reads them, commit evidence of every local rank, ranks by JobSet index."""

import os
import re

import pytest
import yaml

from replicator.coordinator.indices import incarnations
from replicator.local_tier import frameworks
from replicator.local_tier.frameworks import pytorch
from replicator.local_tier.frameworks.base import InvalidReplicatorConfig
from replicator.local_tier.frameworks.pytorch import parse_torch_config
from replicator.wire.messages import JobRef, PodReport
from tests.helpers.reports import pod_report

TORCH = frameworks.get("pytorch.distributed")
# What resiliency/high_scale_ckpt_utils.py's init_high_scale_ckpt dumps (yaml.dump, sort_keys=False).
RESILIENCY = "job-name: llama\nframework: pytorch.distributed\nnode-rank: 1\nnodes: 4\npeers-per-node: 1\nbackup-interval-minutes: 30\n"


def test_the_resiliency_librarys_file_parses_and_our_extensions_derive_the_peers():
    settings = TORCH.parse_config(RESILIENCY, expected_rank=1, expected_nodes=4)
    assert (
        settings.peer_ranks,
        settings.data_parallelism,
        settings.backup_interval_minutes,
        settings.backup_interval_steps,
    ) == ((), 1, 30.0, None)
    ours = (
        RESILIENCY.replace("backup-interval-minutes: 30", "backup-interval-steps: 6")
        + "assume-data-parallelism: 2\nworkers-per-node: 2\n"
    )
    settings = TORCH.parse_config(ours, expected_rank=1, expected_nodes=4)
    assert (settings.peer_ranks, settings.data_parallelism, settings.backup_interval_steps) == ((3,), 2, 6)
    assert parse_torch_config(ours + "peer-ranks: [0]\n", 1, 4).peer_ranks == (0,)


def test_data_parallel_peers_are_the_same_index_in_every_other_group():
    assert pytorch.data_parallel_peers(1, 8, 4) == (3, 5, 7)
    assert pytorch.data_parallel_peers(6, 8, 2) == (2,)
    assert pytorch.data_parallel_peers(0, 4, 1) == ()


@pytest.mark.parametrize(
    "text, field",
    [
        (RESILIENCY.replace("pytorch.distributed", "orbax"), "framework"),
        (RESILIENCY.replace("pytorch.distributed", "pytorch"), "framework"),
        (RESILIENCY.replace("nodes: 4", "nodes: 8"), "nodes"),
        (RESILIENCY.replace("peers-per-node: 1", "peers-per-node: -1"), "peers-per-node"),
        (RESILIENCY + "workers-per-node: 0\n", "workers-per-node"),
        (RESILIENCY + "assume-data-parallelism: 3\n", "assume-data-parallelism"),
        (RESILIENCY + "peer-ranks: [1]\n", "peer-ranks"),
        (RESILIENCY + "backup-interval-steps: 5\n", "backup-interval-minutes/backup-interval-steps"),
        (RESILIENCY.replace("backup-interval-minutes: 30\n", ""), "backup-interval-minutes/backup-interval-steps"),
    ],
)
def test_every_invalid_field_is_named(text, field):
    with pytest.raises(InvalidReplicatorConfig) as err:
        TORCH.parse_config(text, expected_rank=1, expected_nodes=4)
    assert err.value.field == field


def test_a_node_rank_other_than_the_pods_index_says_how_torchrun_must_be_launched():
    with pytest.raises(
        InvalidReplicatorConfig,
        match=r"node-rank: 1 is not the rank assigned to this pod \(2\); .*NODE_RANK.*--node-rank",
    ):
        TORCH.parse_config(RESILIENCY, expected_rank=2, expected_nodes=4)


def resiliency_takes_the_marker(local_dir) -> tuple[int, str | None]:
    """What the Resiliency library's process_replicator_prerestore and block_and_proces_restore_dir do."""
    with open(os.path.join(local_dir, pytorch.PRERESTORE_FILE)) as f:
        announced = int((yaml.safe_load(f) or {}).get("restore-step", 0))
    (marker,) = [name for name in os.listdir(local_dir) if name.endswith(".restore")]
    step = int(re.search(r"-s(\d+)-n\d+-w\d+", marker).group(1))
    if step == 0:
        return announced, None
    os.rename(os.path.join(local_dir, marker), os.path.join(local_dir, f"step={step}"))
    return announced, os.path.join(local_dir, f"step={step}")


def test_a_restore_announces_the_step_then_the_adopted_marker_counts_as_the_committed_step(tmp_path):
    (tmp_path / ".mtc-staged-7" / "rank-0-of-1").mkdir(parents=True)
    (tmp_path / ".mtc-staged-7" / "rank-0-of-1" / ".metadata").write_bytes(b"m")
    TORCH.write_restore_marker(str(tmp_path), "llama", 7, 1)
    announced, path = resiliency_takes_the_marker(tmp_path)
    assert announced == 7 and os.listdir(os.path.join(path, "rank-0-of-1")) == [".metadata"]
    scan = TORCH.scan_steps(str(tmp_path))
    assert (scan.committed, scan.staged, scan.refused) == ([7], [7], [])
    assert TORCH.find_step_dir(str(tmp_path), 7) == str(tmp_path / ".mtc-staged-7")
    assert set(TORCH.step_names(7)) == {"7", "step=7", ".mtc-staged-7"}


def test_a_fresh_start_announces_nothing_and_leaves_a_zero_byte_s0_marker(tmp_path):
    TORCH.write_fresh_start_marker(str(tmp_path), "llama", 1)
    assert resiliency_takes_the_marker(tmp_path) == (0, None)
    assert (tmp_path / "llama-s0-n1-w0.restore").read_bytes() == b""
    TORCH.clear_previous_pod(str(tmp_path))
    assert os.listdir(tmp_path) == []  # a new pod never reads its predecessor's prerestore or marker


def test_the_scan_takes_step_dirs_and_adopted_markers_and_refuses_anything_else_with_their_names(tmp_path):
    (tmp_path / "5").mkdir()
    (tmp_path / "6.tmp").mkdir()  # mtc_torch still writing
    (tmp_path / "elsewhere").mkdir()
    os.symlink("elsewhere", tmp_path / "step=8")  # not our staged dir
    (tmp_path / "9").write_text("a file")
    (tmp_path / "step=11").write_text("a file")
    (tmp_path / "step=10").mkdir()  # a real dir under the adopted name: the job's save (NeMo's), never ours
    scan = TORCH.scan_steps(str(tmp_path))
    assert (scan.committed, scan.staged, scan.refused, scan.uncommitted) == ([5], [], [8, 9, 11], [10])


def files(*paths: str) -> dict[str, tuple[int, str]]:
    return {path: (1, "00000000") for path in paths}


@pytest.mark.parametrize(
    "step, missing",
    [
        (
            files(
                "rank-0-of-2/.metadata", "rank-0-of-2/__0_0.distcp", "rank-1-of-2/.metadata", "rank-1-of-2/__0_0.distcp"
            ),
            None,
        ),
        (files("rank-0-of-2/.metadata", "rank-1-of-2/__0_0.distcp"), "DCP's .metadata of local rank(s) [1] of 2"),
        (files("rank-0-of-2/.metadata"), "DCP's .metadata of local rank(s) [1] of 2"),
        (files("rank-0-of-1/.metadata", "rank-1-of-2/.metadata"), "one local-rank count (its parts name [1, 2])"),
        (files("rank-3-of-2/.metadata", "rank-0-of-2/.metadata"), "DCP's .metadata of local rank(s) [1] of 2"),
        (files("model/.metadata", "model/__0_0.distcp", "common.pt"), None),  # NeMo's own layout
        (files("model/__0_0.distcp"), "a DCP .metadata"),
        ({}, "a DCP .metadata"),
    ],
)
def test_a_step_is_complete_only_when_every_local_rank_wrote_its_metadata(step, missing):
    assert TORCH.missing_commit_evidence(step) == missing


def test_equal_dcp_metadata_signs_equal_and_data_bytes_do_not_count():
    one = {"rank-0-of-1/.metadata": (90, "aa"), "rank-0-of-1/__0_0.distcp": (10, "01")}
    assert TORCH.logical_signature(one) == TORCH.logical_signature({**one, "rank-0-of-1/__0_0.distcp": (10, "02")})
    assert TORCH.logical_signature(one) != TORCH.logical_signature({**one, "rank-0-of-1/.metadata": (90, "ab")})
    assert TORCH.logical_signature({"rank-0-of-1/__0_0.distcp": (10, "01")}) is None


def pods(follow: bool) -> dict[str, tuple[PodReport, str]]:
    """Four pods at JobSet indexes 0..3 on nodes n0..n3."""
    job = JobRef("default", "llama")
    pods = {}
    for i in range(4):
        pod = pod_report(job, 0, i, f"uid{i}", nodes=4, published_at=float(i), ranks_follow_data=follow)
        pods[pod.pod_uid] = (pod, f"n{i}")
    return pods


def test_a_launcher_that_fixes_ranks_gets_each_pod_its_jobset_index_wherever_the_data_is():
    # Node n0 holds rank 3's newest data (a replica): an Orbax pod there takes rank 3; a torchrun pod keeps index 0.
    held = {"n0": {3: 40, 0: 30}}
    orbax = incarnations.assign(pods(True), set(), lambda: held, 0.0)
    torch = incarnations.assign(pods(False), set(), lambda: held, 0.0)
    assert orbax.rank_of_pod["uid0"] == 3
    assert torch.rank_of_pod == {f"uid{i}": i for i in range(4)}


@pytest.mark.parametrize("plant", ["symlink", "dir"])
def test_a_planted_prerestore_is_replaced_never_written_through(tmp_path, plant):
    client, outside = tmp_path / "client", tmp_path / "outside"
    client.mkdir()
    outside.write_text("the node's file")
    (client / ".mtc-staged-3").mkdir()
    if plant == "symlink":
        os.symlink(outside, client / pytorch.PRERESTORE_FILE)
    else:
        (client / pytorch.PRERESTORE_FILE / "deep").mkdir(parents=True)
    TORCH.write_restore_marker(str(client), "llama", 3, 0)
    assert outside.read_text() == "the node's file"
    assert (client / pytorch.PRERESTORE_FILE).read_text() == "restore-step: 3\n"
    assert not (client / pytorch.PRERESTORE_FILE).is_symlink()
