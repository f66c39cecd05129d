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

``Orbax`` is its ``frameworks.Framework``; the names and the ``replicator.yaml`` parser stay module-level.
"""

import hashlib
import json
import os
import re
import stat
import time
from typing import Annotated, Literal

import msgspec
import yaml

from csi_driver import file_cache
from replicator.local_tier import pod_files
from replicator.local_tier.frameworks.base import Files, InvalidReplicatorConfig, StepScan
from replicator.wire.messages import JobSettings

JAX_INIT_INFO_FILE = "jax-init-info.txt"
REPLICATOR_FILE = "replicator.yaml"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
RESTORE_SUFFIX = ".restore"
# Orbax writes it into every step before the commit rename: a step without it is not a checkpoint.
COMMIT_EVIDENCE = "_CHECKPOINT_METADATA"
# Where a restore stages a step before the marker points at it: not a step name, so Orbax ignores it.
STAGED_PREFIX = ".mtc-staged-"

_RESTORE_MARKER = re.compile(r"^.+-s(?P<step>[0-9]+)-n[0-9]+-w[0-9]+\.restore$", re.ASCII)
_MAX_REPLICATOR_YAML_BYTES = 64 << 10
_MAX_REPORT_BYTES = 64 << 10  # the newest part of replicator.errors / .failed


_YAML_NAMES = {"data_parallelism": "assume-data-parallelism", "backup_interval_minutes": "backup-interval-minutes",
               "backup_interval_steps": "backup-interval-steps", "job_name": "job-name", "node_rank": "node-rank",
               "peer_ranks": "peer-ranks"}  # fmt: skip


class ReplicatorConfig(msgspec.Struct, frozen=True, rename=_YAML_NAMES):
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
    """

    job_name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    framework: Literal["orbax"]
    data_parallelism: Annotated[int, msgspec.Meta(ge=1)]
    node_rank: Annotated[int, msgspec.Meta(ge=0)]
    nodes: Annotated[int, msgspec.Meta(ge=1)]
    peer_ranks: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=1 << 17)]
    backup_interval_minutes: Annotated[float, msgspec.Meta(gt=0)] | None = None
    backup_interval_steps: Annotated[int, msgspec.Meta(ge=1)] | None = None


_FIELD_IN_ERROR = re.compile(r"(?:field `|at `\$\.)([a-z-]+)")
_INTERVALS = "backup-interval-minutes/backup-interval-steps"


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
    try:
        config = msgspec.convert(raw, ReplicatorConfig)
    except msgspec.ValidationError as err:
        found = _FIELD_IN_ERROR.search(str(err))
        field = found[1] if found else "(document)"
        value = f" (the file says {field}: {str(raw[field])[:64]!r})" if field in raw else ""
        raise InvalidReplicatorConfig(field, f"{err}{value}") from None
    if config.nodes != expected_nodes:
        raise InvalidReplicatorConfig("nodes", f"{config.nodes} does not match the volume's nodes={expected_nodes}")
    if config.node_rank != expected_rank:
        raise InvalidReplicatorConfig("node-rank", f"{config.node_rank} is not the rank assigned to this pod ({expected_rank})")
    if config.nodes % config.data_parallelism:
        raise InvalidReplicatorConfig("assume-data-parallelism", f"{config.data_parallelism} does not divide nodes={config.nodes}")
    peers = config.peer_ranks
    if any(p >= config.nodes for p in peers) or config.node_rank in peers or len(set(peers)) != len(peers):
        raise InvalidReplicatorConfig("peer-ranks", f"{list(peers)} must be distinct ranks in [0, {config.nodes}) other than node-rank {config.node_rank}")
    intervals = [key for key in _INTERVALS.split("/") if raw.get(key) is not None]
    if len(intervals) != 1:
        raise InvalidReplicatorConfig(_INTERVALS, f"exactly one must be set, got {intervals or 'none'}")
    return config


def restore_marker_name(job: str, step: int, rank: int) -> str:
    """``<job>-s<step>-n<rank>-w0.restore``, matching Orbax's ``_RESTORE_DIR_RE``."""
    return f"{job}-s{step}-n{rank}-w0{RESTORE_SUFFIX}"


def _report(local_dir: str, log_dir: str, name: str, message: str) -> None:
    """Writes a report file from the agent's own log of it, never reading the pod's copy back.

    The log lives in ``log_dir`` (agent-owned). Orbax deletes ``replicator.errors`` once it has
    logged it, so a vanished file means its lines were read: the log starts afresh.
    """
    line = message.rstrip("\n") + "\n"
    with pod_files.open_dir(local_dir) as client, pod_files.open_dir(log_dir) as own:
        pending = pod_files.read_text(own, name + ".log", _MAX_REPORT_BYTES) if pod_files.lstat(client, name) else None
        text = ((pending or "") + line)[-_MAX_REPORT_BYTES:]
        pod_files.write_atomic(own, name + ".log", text.encode())
        pod_files.write_atomic(client, name, text.encode())


class Orbax:
    """Orbax's multi-tier checkpointing, as a ``frameworks.Framework`` (the module docstring gives
    the files). One instance serves every Orbax job of the node: it holds only the scan cache."""

    name = "orbax"

    def __init__(self):
        # local dir -> its last scan; the agent scans every job's dir five times a second.
        self._scans: file_cache.KeyedCache[StepScan] = file_cache.KeyedCache()

    # -- the client dir's layout -----------------------------------------------------------------

    def scan_steps(self, local_dir: str) -> StepScan:
        """What the client dir holds, read without following any link the pod may have planted.

        A committed step is a directory named by an integer, or the symlink Orbax leaves when it adopts
        our restore marker (``<step>`` -> ``.mtc-staged-<step>``, a directory). Any other entry with a
        step's name (a symlink elsewhere, a FIFO, a file) is returned in ``refused``.
        ``<step>.orbax-checkpoint-tmp`` directories are still being written and never count.

        The dir is listed again only when its ``file_cache.Key`` (``fstat`` of the opened dir) changed:
        every create, delete and rename of an entry, Orbax's commit rename included, changes its ctime,
        which the pod cannot set back. A change inside a step directory does not, and is not part of
        a scan.
        """
        since = time.time_ns()
        with pod_files.open_dir(local_dir) as fd:
            key = file_cache.key_of(os.fstat(fd))
            scan = self._scans.get(local_dir, key)
            if scan is None:
                scan = self._scan(fd)
                self._scans.put(local_dir, key, since, scan)
        return _copy(scan)

    def cached_scan(self, local_dir: str) -> StepScan | None:
        """``scan_steps(local_dir)`` if the dir is unchanged since the last scan, else None. It costs
        an open and an ``fstat``, so an event loop may call it, where a full scan of a dir the pod
        fills is work for a thread."""
        with pod_files.open_dir(local_dir) as fd:
            scan = self._scans.get(local_dir, file_cache.key_of(os.fstat(fd)))
        return None if scan is None else _copy(scan)

    def _scan(self, fd: int) -> StepScan:
        committed, staged, refused = [], [], []
        entries = dict(pod_files.names(fd))
        for name, status in entries.items():
            if name.startswith(STAGED_PREFIX):
                step = pod_files.parse_int_name(name[len(STAGED_PREFIX):])
                if step is not None and stat.S_ISDIR(status.st_mode):
                    staged.append(step)
                continue
            step = pod_files.parse_int_name(name)
            if step is None:
                continue
            if stat.S_ISDIR(status.st_mode):
                committed.append(step)
            elif stat.S_ISLNK(status.st_mode) and self._is_adopted_marker(fd, name, step, entries):
                committed.append(step)
            else:
                refused.append(step)
        return StepScan(sorted(committed), sorted(staged), sorted(refused))

    def _is_adopted_marker(self, fd: int, name: str, step: int, entries: dict[str, os.stat_result]) -> bool:
        try:
            target = os.readlink(name, dir_fd=fd)
        except OSError:
            return False
        found = entries.get(target)
        return target == self.staged_name(step) and found is not None and stat.S_ISDIR(found.st_mode)

    def find_step_dir(self, local_dir: str, step: int) -> str | None:
        """The real directory holding ``step``: staged for a marker, or committed. Never a symlink:
        an adopted marker resolves to its staged directory."""
        with pod_files.open_dir(local_dir) as fd:
            for name in (self.staged_name(step), str(step)):
                if pod_files.is_dir(fd, name):
                    return os.path.join(local_dir, name)
        return None

    def staged_name(self, step: int) -> str:
        """``.mtc-staged-<step>``: not a step name, so Orbax ignores it until the marker points at it."""
        return f"{STAGED_PREFIX}{step}"

    def step_names(self, step: int) -> tuple[str, ...]:
        """``<step>`` (a commit, or the marker Orbax adopted) and ``.mtc-staged-<step>``."""
        return str(step), self.staged_name(step)

    def steps_restored_instead(self, scan: StepScan, step: int | None) -> list[int]:
        """The steps of ``scan`` Orbax would restore instead of ``step`` (every one when None): Orbax
        restores the newest step directory it finds, so every committed or refused name newer than it."""
        return [s for s in scan.committed + scan.refused if step is None or s > step]

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
            if path.rsplit("/", 1)[-1] in ("_METADATA", "_sharding") or (path.startswith("process_metadata/") and path.endswith(".json"))
        )
        return hashlib.sha256(json.dumps(structural).encode()).hexdigest() if structural else None

    # -- the hand-shake ----------------------------------------------------------------------------

    def write_init_info(self, local_dir: str, rank: int, coordinator_address: str) -> None:
        """Writes ``jax-init-info.txt`` (``"<rank>\\n<host>:<port>\\n"``, tmp + rename) so Orbax never
        reads half a file; Orbax polls for it 900 s and gives it to ``jax.distributed.initialize``."""
        with pod_files.open_dir(local_dir) as fd:
            pod_files.write_atomic(fd, JAX_INIT_INFO_FILE, f"{rank}\n{coordinator_address}\n".encode())

    def read_config(self, local_dir: str) -> str | None:
        """The job's ``replicator.yaml``, or None while it has not written one.

        Raises:
          pod_files.UnsafeEntry: it is not a regular file (a symlink, a FIFO) or is over 64 KiB.
          UnicodeDecodeError: it is not UTF-8.
        """
        with pod_files.open_dir(local_dir) as fd:
            return pod_files.read_text(fd, REPLICATOR_FILE, _MAX_REPLICATOR_YAML_BYTES)

    def parse_config(self, text: str, expected_rank: int, expected_nodes: int) -> JobSettings:
        """The settings of ``replicator.yaml`` (see ``parse_replicator_config``).

        Raises:
          InvalidReplicatorConfig: naming the field and the value.
        """
        config = parse_replicator_config(text, expected_rank, expected_nodes)
        return JobSettings(config.peer_ranks, config.data_parallelism, config.backup_interval_minutes, config.backup_interval_steps)

    def consume_config(self, local_dir: str) -> None:
        """Deletes ``replicator.yaml``: the job waits for that before it goes on (or reads ``.failed``)."""
        with pod_files.open_dir(local_dir) as fd:
            pod_files.remove(fd, REPLICATOR_FILE)

    def clear_previous_pod(self, local_dir: str) -> None:
        """Removes what a previous pod's protocol run left: its rank, its unconsumed
        ``replicator.yaml`` (Orbax waits for it to vanish before writing its own), reports, markers
        and temporary files of interrupted writes."""
        with pod_files.open_dir(local_dir) as fd:
            for name in (JAX_INIT_INFO_FILE, REPLICATOR_FILE, ERRORS_FILE, FAILED_FILE):
                pod_files.remove(fd, name)
            pod_files.sweep_temp_files(fd)
        self.remove_markers(local_dir)

    # -- restore markers ---------------------------------------------------------------------------

    def write_restore_marker(self, local_dir: str, job: str, step: int, rank: int) -> str:
        """Points a restore marker at the staged step by a relative symlink. Returns the marker's path.

        Raises:
          FileNotFoundError: the step is not staged (see ``staged_name``).
        """
        name, staged = restore_marker_name(job, step, rank), self.staged_name(step)
        with pod_files.open_dir(local_dir) as fd:
            if not pod_files.is_dir(fd, staged):
                raise FileNotFoundError(f"step {step} is not staged at {os.path.join(local_dir, staged)}")
            # Relative: the pod sees this dir at its own mountPath.
            pod_files.write_symlink(fd, name, staged)
        return os.path.join(local_dir, name)

    def write_fresh_start_marker(self, local_dir: str, job: str, rank: int) -> str:
        """Writes the zero-byte ``s0`` marker: no checkpoint exists, start from scratch. Returns its path."""
        name = restore_marker_name(job, 0, rank)
        with pod_files.open_dir(local_dir) as fd:
            pod_files.write_atomic(fd, name, b"")
        return os.path.join(local_dir, name)

    def remove_markers(self, local_dir: str) -> None:
        """Removes restore markers a previous incarnation left unconsumed."""
        with pod_files.open_dir(local_dir) as fd:
            for name, _ in pod_files.names(fd):
                if _RESTORE_MARKER.match(name):
                    pod_files.remove(fd, name)

    # -- the error files ---------------------------------------------------------------------------

    def report_error(self, local_dir: str, log_dir: str, message: str) -> None:
        """Appends a recoverable error to ``replicator.errors``; Orbax logs it and deletes the file.

        Args:
          local_dir: the client dir.
          log_dir: an agent-owned directory of the same job, where the file's content is kept.
        """
        _report(local_dir, log_dir, ERRORS_FILE, message)

    def report_failure(self, local_dir: str, log_dir: str, message: str) -> None:
        """Writes ``replicator.failed``: Orbax raises ``RuntimeError`` with this message."""
        _report(local_dir, log_dir, FAILED_FILE, message)


def _copy(scan: StepScan) -> StepScan:
    return StepScan(list(scan.committed), list(scan.staged), list(scan.refused))  # the caller's own lists
