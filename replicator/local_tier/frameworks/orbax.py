"""The Orbax multi-tier-checkpointing file protocol: every name, format and atomic write in one place.

The other side is Orbax's ``orbax/checkpoint/experimental/emergency/multi_tier_checkpointing/
initialization.py`` (verified against orbax-checkpoint 0.12.8; pyproject.toml says why >= 0.12.3). Everything
happens through files in the pod's local checkpoint directory (the ramdisk's client dir):

- ``jax-init-info.txt``: we write ``"<process_id>\\n<host>:<port>\\n"``; Orbax polls for it (900 s).
- ``replicator.yaml``: the job writes its settings; we validate and consume it by deleting it.
- ``replicator.errors`` / ``replicator.failed``: we report; Orbax logs and deletes the first, and
  raises ``RuntimeError`` on the second.
- ``<job>-s<step>-n<rank>-w<worker>.restore``: our restore marker. Orbax waits 300 s for it, then
  ``os.replace``s the marker itself onto ``<local>/<step>``. So a symlink marker must point at a
  directory with another name, by a relative target (the pod mounts the dir elsewhere), and
  ``<local>/<step>`` must not exist. A zero-byte regular file with step 0 means "start fresh".
- ``<step>.orbax-checkpoint-tmp/`` renamed to ``<step>/``: a committed local save.

``Orbax`` is its ``frameworks.Framework``; what it shares with the PyTorch protocol (markers, error
files, the scan) is ``client_dir.ClientDirProtocol``.
"""

import hashlib
import json
import re
from typing import Annotated, Literal

import msgspec

from replicator.local_tier import pod_files
from replicator.local_tier.frameworks.base import Files, InvalidReplicatorConfig
from replicator.local_tier.frameworks.client_dir import (
    ERRORS_FILE,
    FAILED_FILE,
    REPLICATOR_FILE,
    RESTORE_SUFFIX,
    STAGED_PREFIX,
    YAML_KEYS,
    ClientDirProtocol,
    IntervalSteps,
    PeerRanks,
    check_job_shape,
    checked_redundancy,
    load_config,
    restore_marker_name,
)
from replicator.wire.messages import Count, JobSettings, Rank

__all__ = [
    "COMMIT_EVIDENCE",
    "ERRORS_FILE",
    "FAILED_FILE",
    "JAX_INIT_INFO_FILE",
    "REPLICATOR_FILE",
    "RESTORE_SUFFIX",
    "STAGED_PREFIX",
    "InvalidReplicatorConfig",
    "Orbax",
    "ReplicatorConfig",
    "parse_replicator_config",
    "restore_marker_name",
]

JAX_INIT_INFO_FILE = "jax-init-info.txt"
# Orbax writes it into every step before the commit rename: a step without it is not a checkpoint.
COMMIT_EVIDENCE = "_CHECKPOINT_METADATA"


class ReplicatorConfig(msgspec.Struct, frozen=True, rename=YAML_KEYS):
    """A validated ``replicator.yaml``, as Orbax's ``_create_replicator_file`` writes it; msgspec
    checks each key's type and range, ``parse_replicator_config`` the rest.

    Attributes:
      job_name: ``job-name``, the run name.
      framework: ``framework`` (``orbax``).
      data_parallelism: ``assume-data-parallelism``, the number of data-parallel replicas (>= 1).
      node_rank: ``node-rank``, this process's rank.
      nodes: ``nodes``, the job's node count.
      peer_ranks: ``peer-ranks``, the same in-slice index in every other slice.
      backup_interval_minutes: ``backup-interval-minutes``, or None.
      backup_interval_steps: ``backup-interval-steps``, or None; exactly one of the two is set.
      redundancy: ``redundancy`` (ours, not Orbax's: ``replicas``, ``xor:N`` or ``rs:N:K``), or None for the
        agents' ``--redundancy``.
    """

    job_name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    framework: Literal["orbax"]
    data_parallelism: Count
    node_rank: Rank
    nodes: Count
    peer_ranks: PeerRanks
    backup_interval_minutes: Annotated[float, msgspec.Meta(gt=0)] | None = None
    backup_interval_steps: IntervalSteps | None = None
    redundancy: str | None = None


def parse_replicator_config(text: str, expected_rank: int, expected_nodes: int) -> ReplicatorConfig:
    """Parses and validates ``replicator.yaml`` against the rank this node assigned.

    Args:
      text: the file's contents.
      expected_rank: the rank written to this pod's ``jax-init-info.txt``.
      expected_nodes: the job's node count from the volume attributes.

    Raises:
      InvalidReplicatorConfig: naming the field and the value.
    """
    config, raw = load_config(text, ReplicatorConfig)
    check_job_shape(
        raw, config.node_rank, config.nodes, config.data_parallelism, config.peer_ranks, expected_rank, expected_nodes
    )
    return config


class Orbax(ClientDirProtocol):
    """Orbax's multi-tier checkpointing, as a ``frameworks.Framework`` (the module docstring gives
    the files; ``ClientDirProtocol`` the parts the PyTorch protocol shares)."""

    name = "orbax"
    ranks_follow_data = True
    handshake_files = (JAX_INIT_INFO_FILE, *ClientDirProtocol.handshake_files)
    unfinished_save = re.compile(r"^[0-9]{1,18}\.orbax-checkpoint-tmp(-[0-9]+)?$")  # older Orbax adds a timestamp

    # -- commit evidence ---------------------------------------------------------------------------

    def missing_commit_evidence(self, files: Files) -> str | None:
        """Orbax writes ``_CHECKPOINT_METADATA`` into every step before the commit rename: an empty
        or partial manifest (a step that vanished while it was checksummed) lacks it."""
        return None if COMMIT_EVIDENCE in files else f"Orbax's {COMMIT_EVIDENCE}"

    def logical_signature(self, files: Files) -> str | None:
        """A SHA-256 hex digest of the checksums of a step's structural metadata: the pytree
        (``_METADATA``), its shardings (``_sharding``) and the process metadata; None when the step has
        none. Data-parallel peers write different array bytes (``ocdbt.process_<i>``) but identical
        structure; with the job's ``assume-data-parallelism`` promise equal signatures are what we check
        before treating one peer's step as the other's.
        """
        structural = sorted(
            (path, size, crc)
            for path, (size, crc) in files.items()
            if path.rsplit("/", 1)[-1] in ("_METADATA", "_sharding")
            or (path.startswith("process_metadata/") and path.endswith(".json"))
        )
        return hashlib.sha256(json.dumps(structural).encode()).hexdigest() if structural else None

    # -- the hand-shake ----------------------------------------------------------------------------

    def write_init_info(self, local_dir: str, rank: int, coordinator_address: str) -> None:
        """Writes ``jax-init-info.txt`` (``"<rank>\\n<host>:<port>\\n"``, tmp + rename) so Orbax never
        reads half a file; Orbax polls for it 900 s and gives it to ``jax.distributed.initialize``."""
        with pod_files.open_dir(local_dir) as fd:
            pod_files.write_atomic(fd, JAX_INIT_INFO_FILE, f"{rank}\n{coordinator_address}\n".encode())

    def parse_config(self, text: str, expected_rank: int, expected_nodes: int) -> JobSettings:
        """The settings of ``replicator.yaml`` (see ``parse_replicator_config``).

        Raises:
          InvalidReplicatorConfig: naming the field and the value.
        """
        config = parse_replicator_config(text, expected_rank, expected_nodes)
        return JobSettings(
            config.peer_ranks,
            config.data_parallelism,
            config.backup_interval_minutes,
            config.backup_interval_steps,
            checked_redundancy(config.redundancy),
        )
