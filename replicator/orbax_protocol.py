"""The Orbax multi-tier-checkpointing file protocol: every name, format and atomic write in one place.

The other side is Orbax's ``orbax/checkpoint/experimental/emergency/multi_tier_checkpointing/
initialization.py`` (verified against orbax-checkpoint 0.12.8, compatible with >= 0.11.20). Everything
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
"""

import contextlib
import dataclasses
import os
import re

import yaml

JAX_INIT_INFO_FILE = "jax-init-info.txt"
REPLICATOR_FILE = "replicator.yaml"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
RESTORE_SUFFIX = ".restore"
# Where a restore stages a step before the marker points at it: not a step name, so Orbax ignores it.
STAGED_PREFIX = ".mtc-staged-"

_STEP_DIR = re.compile(r"^\d+$")
_RESTORE_MARKER = re.compile(r"^.+-s(?P<step>\d+)-n\d+-w\d+\.restore$")
_REQUIRED_KEYS = ("job-name", "framework", "assume-data-parallelism", "node-rank", "nodes", "peer-ranks")
_INTERVAL_KEYS = ("backup-interval-minutes", "backup-interval-steps")


class InvalidReplicatorConfig(ValueError):
    """``replicator.yaml`` is unusable; ``field`` names the offending key."""

    def __init__(self, field: str, message: str):
        super().__init__(f"replicator.yaml field {field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class ReplicatorConfig:
    """A validated ``replicator.yaml``, as Orbax's ``_create_replicator_file`` writes it.

    Attributes:
      job_name: ``job-name``, the run name.
      framework: ``framework`` (``orbax``).
      data_parallelism: ``assume-data-parallelism``, the number of data-parallel replicas (>= 1).
      node_rank: ``node-rank``, this process's rank.
      nodes: ``nodes``, the job's node count.
      peer_ranks: ``peer-ranks``, the same in-slice index in every other slice.
      backup_interval_minutes: ``backup-interval-minutes``, or None.
      backup_interval_steps: ``backup-interval-steps``, or None; exactly one of the two is set.
    """

    job_name: str
    framework: str
    data_parallelism: int
    node_rank: int
    nodes: int
    peer_ranks: tuple[int, ...]
    backup_interval_minutes: float | None
    backup_interval_steps: int | None


def _int_field(raw: dict, key: str, minimum: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidReplicatorConfig(key, f"{value!r} is not an integer >= {minimum}")
    return value


def parse_replicator_config(text: str, expected_rank: int, expected_nodes: int) -> ReplicatorConfig:
    """Parses and validates ``replicator.yaml`` against the rank this node assigned.

    Args:
      text: the file's contents.
      expected_rank: the rank written to this pod's ``jax-init-info.txt``.
      expected_nodes: the job's node count from the volume attributes.

    Raises:
      InvalidReplicatorConfig: naming the field and the value.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InvalidReplicatorConfig("(document)", f"not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise InvalidReplicatorConfig("(document)", f"expected a mapping of keys, got {type(raw).__name__}")
    for key in _REQUIRED_KEYS:
        if key not in raw:
            raise InvalidReplicatorConfig(key, "is missing")
    job_name = raw["job-name"]
    if not isinstance(job_name, str) or not job_name:
        raise InvalidReplicatorConfig("job-name", f"{job_name!r} is not a name")
    if raw["framework"] != "orbax":
        raise InvalidReplicatorConfig("framework", f"{raw['framework']!r} is not supported (only orbax)")
    nodes = _int_field(raw, "nodes", 1)
    if nodes != expected_nodes:
        raise InvalidReplicatorConfig("nodes", f"{nodes} does not match the volume's nodes={expected_nodes}")
    rank = _int_field(raw, "node-rank", 0)
    if rank != expected_rank:
        raise InvalidReplicatorConfig("node-rank", f"{rank} is not the rank assigned to this pod ({expected_rank})")
    data_parallelism = _int_field(raw, "assume-data-parallelism", 1)
    if nodes % data_parallelism:
        raise InvalidReplicatorConfig("assume-data-parallelism", f"{data_parallelism} does not divide nodes={nodes}")
    peers = raw["peer-ranks"]
    if not isinstance(peers, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in peers):
        raise InvalidReplicatorConfig("peer-ranks", f"{peers!r} is not a list of ranks")
    if any(not 0 <= p < nodes for p in peers) or rank in peers or len(set(peers)) != len(peers):
        raise InvalidReplicatorConfig("peer-ranks", f"{peers} must be distinct ranks in [0, {nodes}) other than node-rank {rank}")
    intervals = [key for key in _INTERVAL_KEYS if raw.get(key) is not None]
    if len(intervals) != 1:
        raise InvalidReplicatorConfig("backup-interval-minutes/backup-interval-steps", f"exactly one must be set, got {intervals or 'none'}")
    interval = raw[intervals[0]]
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        raise InvalidReplicatorConfig(intervals[0], f"{interval!r} is not a positive number")
    return ReplicatorConfig(
        job_name=job_name,
        framework="orbax",
        data_parallelism=data_parallelism,
        node_rank=rank,
        nodes=nodes,
        peer_ranks=tuple(peers),
        backup_interval_minutes=float(interval) if intervals[0] == _INTERVAL_KEYS[0] else None,
        backup_interval_steps=int(interval) if intervals[0] == _INTERVAL_KEYS[1] else None,
    )


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.mtc-tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_jax_init_info(local_dir: str, process_id: int, coordinator_address: str) -> None:
    """Writes ``jax-init-info.txt`` (tmp + rename) so Orbax never reads half a file.

    Args:
      process_id: the node rank.
      coordinator_address: ``host:port`` of rank 0's JAX coordinator.
    """
    _write_atomically(os.path.join(local_dir, JAX_INIT_INFO_FILE), f"{process_id}\n{coordinator_address}\n")


def _append(path: str, message: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        with open(path, encoding="utf-8") as f:
            message = f.read() + message
    _write_atomically(path, message)


def report_error(local_dir: str, message: str) -> None:
    """Appends a recoverable error to ``replicator.errors``; Orbax logs it and deletes the file."""
    _append(os.path.join(local_dir, ERRORS_FILE), message.rstrip("\n") + "\n")


def report_failure(local_dir: str, message: str) -> None:
    """Writes ``replicator.failed``: Orbax raises ``RuntimeError`` with this message."""
    _append(os.path.join(local_dir, FAILED_FILE), message.rstrip("\n") + "\n")


def restore_marker_name(job: str, step: int, rank: int) -> str:
    """``<job>-s<step>-n<rank>-w0.restore``, matching Orbax's ``_RESTORE_DIR_RE``."""
    return f"{job}-s{step}-n{rank}-w0{RESTORE_SUFFIX}"


def write_fresh_start_marker(local_dir: str, job: str, rank: int) -> str:
    """Writes the zero-byte ``s0`` marker: no checkpoint exists, start from scratch. Returns its path."""
    path = os.path.join(local_dir, restore_marker_name(job, 0, rank))
    _write_atomically(path, "")
    return path


def staged_step_dir(local_dir: str, step: int) -> str:
    """Where a step waits for Orbax to adopt it through a restore marker."""
    return os.path.join(local_dir, f"{STAGED_PREFIX}{step}")


def write_restore_marker(local_dir: str, job: str, step: int, rank: int) -> str:
    """Points a restore marker at the staged step by a relative symlink. Returns the marker's path.

    Raises:
      FileNotFoundError: the step is not staged (see ``staged_step_dir``).
    """
    staged = staged_step_dir(local_dir, step)
    if not os.path.isdir(staged):
        raise FileNotFoundError(f"step {step} is not staged at {staged}")
    path = os.path.join(local_dir, restore_marker_name(job, step, rank))
    tmp = path + ".mtc-tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(os.path.basename(staged), tmp)  # relative: the pod sees this dir at its own mountPath
    os.replace(tmp, path)
    return path


def clear_previous_pod(local_dir: str) -> None:
    """Removes what a previous pod's protocol run left: its rank, its unconsumed
    ``replicator.yaml`` (Orbax waits for it to vanish before writing its own), reports and markers."""
    for name in (JAX_INIT_INFO_FILE, REPLICATOR_FILE, ERRORS_FILE, FAILED_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(local_dir, name))
    remove_markers(local_dir)


def remove_markers(local_dir: str) -> None:
    """Removes restore markers a previous incarnation left unconsumed."""
    for name in os.listdir(local_dir):
        if _RESTORE_MARKER.match(name):
            os.unlink(os.path.join(local_dir, name))


def committed_steps(local_dir: str) -> list[int]:
    """Steps committed in ``local_dir``: directories (or symlinks to them) named by an integer.

    ``<step>.orbax-checkpoint-tmp`` directories are still being written and never count.
    """
    steps = []
    for entry in os.scandir(local_dir):
        if _STEP_DIR.match(entry.name) and entry.is_dir():
            steps.append(int(entry.name))
    return sorted(steps)


def held_steps(local_dir: str) -> list[int]:
    """Committed steps plus steps staged for a restore marker: everything the dir holds."""
    staged = [int(e.name[len(STAGED_PREFIX):]) for e in os.scandir(local_dir)
              if e.name.startswith(STAGED_PREFIX) and e.name[len(STAGED_PREFIX):].isdigit() and e.is_dir()]  # fmt: skip
    return sorted(set(committed_steps(local_dir)) | set(staged))


def find_step_dir(local_dir: str, step: int) -> str | None:
    """The directory holding ``step``: staged for a marker, or committed (possibly behind a symlink)."""
    staged = staged_step_dir(local_dir, step)
    if os.path.isdir(staged):
        return staged
    committed = os.path.join(local_dir, str(step))
    return committed if os.path.isdir(committed) else None


def logical_signature(files: dict[str, tuple[int, str]]) -> frozenset[tuple[str, int, str]]:
    """The checksums of a step's structural metadata: the pytree (``_METADATA``), its shardings
    (``_sharding``) and the process metadata. Data-parallel peers write different array bytes
    (``ocdbt.process_<i>``) but identical structure; with the job's ``assume-data-parallelism``
    promise this is what we check before treating one peer's step as the other's.
    """
    return frozenset(
        (path, size, crc)
        for path, (size, crc) in files.items()
        if path.rsplit("/", 1)[-1] in ("_METADATA", "_sharding") or (path.startswith("process_metadata/") and path.endswith(".json"))
    )
