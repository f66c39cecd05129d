"""The Orbax file protocol: replicator.yaml validation, markers, commit detection."""

import os

import pytest

from replicator.local_tier import frameworks
from replicator.local_tier.frameworks import orbax
from replicator.local_tier.frameworks.orbax import InvalidReplicatorConfig, parse_replicator_config

ORBAX = frameworks.get("orbax")

# Exactly what Orbax 0.12.8's _create_replicator_file writes (no trailing newline).
VALID = "job-name: run\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 1\nnodes: 4\npeer-ranks: [3]\nbackup-interval-steps: 6"


def with_line(key, value):
    lines = [line for line in VALID.split("\n") if not line.startswith(key + ":")]
    return "\n".join(lines + ([f"{key}: {value}"] if value is not None else []))


def test_valid_file_parses_to_typed_settings():
    config = parse_replicator_config(VALID, expected_rank=1, expected_nodes=4)
    assert (config.job_name, config.node_rank, config.nodes, config.peer_ranks) == ("run", 1, 4, (3,))
    assert (config.data_parallelism, config.backup_interval_steps, config.backup_interval_minutes) == (2, 6, None)
    minutes = parse_replicator_config(with_line("backup-interval-steps", None) + "\nbackup-interval-minutes: 30", 1, 4)
    assert (minutes.backup_interval_minutes, minutes.backup_interval_steps) == (30.0, None)


@pytest.mark.parametrize(
    "text, field",
    [
        ("job-name: [unclosed", "(document)"),
        ("- a list", "(document)"),
        (with_line("job-name", None), "job-name"),
        (with_line("framework", "pytorch"), "framework"),
        (with_line("framework", None), "framework"),
        (with_line("assume-data-parallelism", "0"), "assume-data-parallelism"),
        (with_line("assume-data-parallelism", "3"), "assume-data-parallelism"),
        (with_line("assume-data-parallelism", None), "assume-data-parallelism"),
        (with_line("node-rank", "2"), "node-rank"),
        (with_line("node-rank", "one"), "node-rank"),
        (with_line("node-rank", None), "node-rank"),
        (with_line("nodes", "8"), "nodes"),
        (with_line("nodes", None), "nodes"),
        (with_line("peer-ranks", "[4]"), "peer-ranks"),
        (with_line("peer-ranks", "[1]"), "peer-ranks"),
        (with_line("peer-ranks", "[3, 3]"), "peer-ranks"),
        (with_line("peer-ranks", "3"), "peer-ranks"),
        (with_line("peer-ranks", None), "peer-ranks"),
        (with_line("backup-interval-steps", "0"), "backup-interval-steps"),
        (with_line("backup-interval-steps", None), "backup-interval-minutes/backup-interval-steps"),
        (VALID + "\nbackup-interval-minutes: 5", "backup-interval-minutes/backup-interval-steps"),
    ],
)
def test_every_invalid_field_is_named(text, field):
    with pytest.raises(InvalidReplicatorConfig) as err:
        parse_replicator_config(text, expected_rank=1, expected_nodes=4)
    assert err.value.field == field
    assert field in str(err.value)


def test_committed_steps_ignore_half_written_tmp_dirs(tmp_path):
    for name in ("3", "6.orbax-checkpoint-tmp", "restore-9", "jax-init-info.txt"):
        (tmp_path / name).mkdir() if "." not in name or "tmp" in name else (tmp_path / name).write_text("x")
    os.symlink(orbax.STAGED_PREFIX + "12", tmp_path / "12")
    (tmp_path / (orbax.STAGED_PREFIX + "12")).mkdir()
    assert ORBAX.scan_steps(str(tmp_path)).committed == [3, 12]
    assert ORBAX.scan_steps(str(tmp_path)).held == [3, 12]


def test_restore_marker_is_a_relative_symlink_orbax_can_rename(tmp_path):
    staged = os.path.join(str(tmp_path), ORBAX.staged_name(9))
    os.makedirs(os.path.join(staged, "state"))
    marker = ORBAX.write_restore_marker(str(tmp_path), "run", 9, 2)
    assert os.path.basename(marker) == "run-s9-n2-w0.restore"
    assert os.readlink(marker) == os.path.basename(staged)
    os.replace(marker, tmp_path / "9")  # what Orbax does with the marker
    assert (tmp_path / "9" / "state").is_dir()
    fresh = ORBAX.write_fresh_start_marker(str(tmp_path), "run", 0)
    assert os.path.isfile(fresh) and os.path.getsize(fresh) == 0 and fresh.endswith("run-s0-n0-w0.restore")
    with pytest.raises(FileNotFoundError):
        ORBAX.write_restore_marker(str(tmp_path), "run", 15, 0)


def test_errors_accumulate_until_orbax_consumes_them(tmp_path):
    log_dir = tmp_path / "agent-owned"
    log_dir.mkdir()
    client = tmp_path / "client"
    client.mkdir()
    tmp_path = client
    ORBAX.report_error(str(tmp_path), str(log_dir), "first")
    ORBAX.report_error(str(tmp_path), str(log_dir), "second")
    assert (tmp_path / "replicator.errors").read_text() == "first\nsecond\n"
