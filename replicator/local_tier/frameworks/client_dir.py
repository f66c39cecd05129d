"""What the Orbax and PyTorch protocols share: the client dir's step names, restore markers, the
``replicator.yaml`` hand-shake and the error files. Both come from Google's multi-tier checkpointing
(Orbax's ``multi_tier_checkpointing`` and the Resiliency library's ``high_scale_ckpt_utils.py``
speak the same files except where a subclass says otherwise).

``ClientDirProtocol`` implements every ``Framework`` method that does not depend on what a
step holds; a framework module subclasses it with its names (``adopted_name``, ``handshake_files``)
and its own config, commit evidence and signature.
"""

import os
import re
import stat
import time
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec

from csi_driver import file_cache
from replicator.local_tier import pod_files, pod_yaml
from replicator.local_tier.frameworks.base import ConfigFile, InvalidReplicatorConfig, StepScan
from replicator.wire import redundancy
from replicator.wire.messages import MAX_RANKS, Rank

REPLICATOR_FILE = "replicator.yaml"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
RESTORE_SUFFIX = ".restore"
# Where a restore stages a step before the marker points at it: not a step name, so the job ignores it.
STAGED_PREFIX = ".mtc-staged-"
# An elastic restore's staged step: old nodes' copies (``node-<n>-of-<N>/``), never a step of this node.
RESHARDED_PREFIX = ".mtc-resharded-"

_RESTORE_MARKER = re.compile(r"^.+-s(?P<step>[0-9]+)-n[0-9]+-w[0-9]+\.restore$", re.ASCII)
MAX_REPLICATOR_YAML_BYTES = 64 << 10
_MAX_REPORT_BYTES = 64 << 10  # the newest part of replicator.errors / .failed
_FIELD_IN_ERROR = re.compile(r"(?:field `|at `\$\.)([a-z-]+)")
INTERVALS = "backup-interval-minutes/backup-interval-steps"
# The replicator.yaml keys every framework's file has, by the field names of its msgspec struct.
YAML_KEYS = {
    "data_parallelism": "assume-data-parallelism",
    "backup_interval_minutes": "backup-interval-minutes",
    "backup_interval_steps": "backup-interval-steps",
    "job_name": "job-name",
    "node_rank": "node-rank",
    "peer_ranks": "peer-ranks",
}

Config = TypeVar("Config", bound=msgspec.Struct)
# The integer keys' types, bounded above as the wire's (msgspec.convert passes a Python int of any
# size): a rank or count the coordinator could not take is refused here, naming its key.
PeerRanks = Annotated[tuple[Rank, ...], msgspec.Meta(max_length=MAX_RANKS)]
IntervalSteps = Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]


def restore_marker_name(job: str, step: int, rank: int) -> str:
    """``<job>-s<step>-n<rank>-w0.restore``: the name Orbax's ``_RESTORE_DIR_RE`` and the Resiliency
    library's ``-s(\\d+)-n\\d+-w\\d+`` both match."""
    return f"{job}-s{step}-n{rank}-w0{RESTORE_SUFFIX}"


def checked_redundancy(value: str | None) -> str | None:
    """A ``redundancy`` key's value (``replicator.wire.redundancy``), in its canonical form, or None when absent.

    Raises:
      InvalidReplicatorConfig: not ``replicas``, ``xor:N`` or ``rs:N:K`` within bounds.
    """
    if value is None:
        return None
    try:
        return str(redundancy.parse(value))
    except ValueError as err:
        raise InvalidReplicatorConfig("redundancy", str(err)) from None


def load_config(text: str, kind: type[Config]) -> tuple[Config, dict[str, Any]]:
    """Parses ``replicator.yaml`` into ``kind`` (a msgspec Struct checking each key's type and range),
    within bounds of time and memory (``pod_yaml``: no anchors or aliases, nesting at most 8 deep).

    Returns:
      (the config, the raw mapping): the raw keys tell which optional keys the file set.

    Raises:
      InvalidReplicatorConfig: not YAML, an anchor, an alias or deep nesting (``final``), not a mapping,
        or a key of the wrong type or range. Its message shows the offending value's type and at most a
        short prefix of it.
    """
    try:
        raw = pod_yaml.load(text)
    except pod_yaml.RefusedYaml as err:
        raise InvalidReplicatorConfig("(document)", str(err), final=err.final) from None
    if raw is None and not text.strip():
        raise InvalidReplicatorConfig("(document)", "the file is empty")
    if not isinstance(raw, dict):
        raise InvalidReplicatorConfig("(document)", f"expected a mapping of keys, got {pod_yaml.describe(raw)}")
    try:
        return msgspec.convert(raw, kind), raw
    except msgspec.ValidationError as err:
        found = _FIELD_IN_ERROR.search(str(err))
        field = found[1] if found else "(document)"
        value = f" (the file says {field}: {pod_yaml.describe(raw[field])})" if field in raw else ""
        # msgspec's message may quote the value (an enum's): a prefix leaves room for the description.
        raise InvalidReplicatorConfig(field, f"{pod_yaml.bounded(str(err), 200)}{value}") from None


def check_job_shape(
    raw: Mapping[str, Any],
    node_rank: int,
    nodes: int,
    data_parallelism: int,
    peer_ranks: tuple[int, ...],
    expected_rank: int,
    expected_nodes: int,
    rank_hint: str = "",
) -> None:
    """The checks every ``replicator.yaml`` passes: its shape against the volume's and the rank this
    node assigned, its peers, and exactly one backup interval.

    Args:
      rank_hint: appended to a ``node-rank`` mismatch (how the job chooses its rank).

    Raises:
      InvalidReplicatorConfig: naming the field and the value.
    """
    if nodes != expected_nodes:
        raise InvalidReplicatorConfig(
            "nodes",
            f"{nodes} does not match the job's nodes={expected_nodes} (the volume's attribute, else the API server's shape)",
        )
    if node_rank != expected_rank:
        raise InvalidReplicatorConfig(
            "node-rank", f"{node_rank} is not the rank assigned to this pod ({expected_rank}){rank_hint}"
        )
    if nodes % data_parallelism:
        raise InvalidReplicatorConfig("assume-data-parallelism", f"{data_parallelism} does not divide nodes={nodes}")
    if any(p >= nodes for p in peer_ranks) or node_rank in peer_ranks or len(set(peer_ranks)) != len(peer_ranks):
        raise InvalidReplicatorConfig(
            "peer-ranks",
            f"{pod_yaml.describe(peer_ranks)} must be distinct ranks in [0, {nodes}) other than node-rank {node_rank}",
        )
    intervals = [key for key in INTERVALS.split("/") if raw.get(key) is not None]
    if len(intervals) != 1:
        raise InvalidReplicatorConfig(INTERVALS, f"exactly one must be set, got {intervals or 'none'}")


def _report(local_dir: str, log_dir: str, name: str, message: str) -> None:
    """Writes a report file from the agent's own log of it, never reading the pod's copy back.

    The log lives in ``log_dir`` (agent-owned). The job deletes ``replicator.errors`` once it has
    logged it, so a vanished file means its lines were read: the log starts afresh.
    """
    line = message.rstrip("\n") + "\n"
    with pod_files.open_dir(local_dir) as client, pod_files.open_dir(log_dir) as own:
        pending = pod_files.read_text(own, name + ".log", _MAX_REPORT_BYTES) if pod_files.lstat(client, name) else None
        text = ((pending or "") + line)[-_MAX_REPORT_BYTES:]
        pod_files.write_atomic(own, name + ".log", text.encode())
        pod_files.write_atomic(client, name, text.encode())


class ClientDirProtocol:
    """The ``Framework`` methods both protocols share (see the module docstring). One instance
    serves every job of its framework on the node: it holds only the scan cache.

    Class attributes a subclass sets:
      handshake_files: the hand-shake files a new pod must not find (``clear_previous_pod``).
      unfinished_save: the names a save has until the job commits it (``clear_previous_pod`` removes
        those of earlier pods).
      unfinished_mark: the suffix of the empty file with which the job marks a save under a step's
        name unfinished beside it (``<name><suffix>``); None when it marks none.
    """

    handshake_files: tuple[str, ...] = (REPLICATOR_FILE, ERRORS_FILE, FAILED_FILE)
    unfinished_save: re.Pattern = re.compile(r"^[0-9]{1,18}\.tmp$")
    unfinished_mark: str | None = None

    def __init__(self):
        # local dir -> its last scan; the agent scans every job's dir five times a second.
        self._scans: file_cache.KeyedCache[StepScan] = file_cache.KeyedCache()

    def adopted_name(self, step: int) -> str:
        """The name the job renames our marker to when it takes it (Orbax: ``<step>``)."""
        return str(step)

    def _adopted_step(self, name: str) -> int | None:
        """The step of ``name`` if it is an adopted marker's name, else None."""
        return pod_files.parse_int_name(name)

    # -- the client dir's layout -----------------------------------------------------------------

    def scan_steps(self, local_dir: str) -> StepScan:
        """What the client dir holds, read without following any link the pod may have planted.

        A committed step is a directory named by an integer, or the symlink the job leaves when it
        adopts our restore marker (``adopted_name(step)`` -> ``.mtc-staged-<step>``, a directory). A
        real directory under the adopted name is the job's own save, not yet committed: a restore
        only ever places a symlink there. It is ``uncommitted``, or not a step at all while the job
        marks it unfinished (``unfinished_mark``: the job removes it itself). Any other entry with
        one of those names (a symlink elsewhere, a FIFO, a file) is returned in ``refused``. Names
        still being written (``<step>.orbax-checkpoint-tmp``, ``<step>.tmp``) are not step names and
        never count.

        The dir is listed again only when its ``file_cache.Key`` (``fstat`` of the opened dir) changed:
        every create, delete and rename of an entry, the job's commit rename included, changes its
        ctime, which the pod cannot set back. A change inside a step directory does not, and is not
        part of a scan.
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
        committed, staged, refused, uncommitted = set(), set(), set(), set()
        entries = dict(pod_files.names(fd))
        for name, status in entries.items():
            if name.startswith(STAGED_PREFIX):
                step = pod_files.parse_int_name(name[len(STAGED_PREFIX) :])
                if step is not None and stat.S_ISDIR(status.st_mode):
                    staged.add(step)
                continue
            step, adopted = pod_files.parse_int_name(name), self._adopted_step(name)
            if step is not None and stat.S_ISDIR(status.st_mode):
                committed.add(step)
            elif (
                adopted is not None
                and stat.S_ISLNK(status.st_mode)
                and self._is_adopted_marker(fd, name, adopted, entries)
            ):
                committed.add(adopted)
            elif (
                adopted is not None
                and stat.S_ISLNK(status.st_mode)
                and self._is_adopted_marker(fd, name, adopted, entries, self.resharded_name(adopted))
            ):
                continue  # an elastic restore the job took: other nodes' data, no step of this node
            elif adopted is not None and stat.S_ISDIR(status.st_mode):
                if self.unfinished_mark is None or name + self.unfinished_mark not in entries:
                    uncommitted.add(adopted)
            elif step is not None:
                refused.add(step)
            elif adopted is not None:
                refused.add(adopted)
        return StepScan(sorted(committed), sorted(staged), sorted(refused - committed), sorted(uncommitted))

    def _is_adopted_marker(
        self, fd: int, name: str, step: int, entries: dict[str, os.stat_result], staged: str | None = None
    ) -> bool:
        """Whether ``name`` is a symlink to the directory ``staged`` (by default ``staged_name(step)``)."""
        try:
            target = os.readlink(name, dir_fd=fd)
        except OSError:
            return False
        found = entries.get(target)
        return target == (staged or self.staged_name(step)) and found is not None and stat.S_ISDIR(found.st_mode)

    def find_step_dir(self, local_dir: str, step: int) -> str | None:
        """The real directory holding ``step``: staged for a marker, or committed. Never a symlink:
        an adopted marker resolves to its staged directory."""
        with pod_files.open_dir(local_dir) as fd:
            for name in (self.staged_name(step), str(step)):
                if pod_files.is_dir(fd, name):
                    return os.path.join(local_dir, name)
        return None

    def staged_name(self, step: int) -> str:
        """``.mtc-staged-<step>``: not a step name, so the job ignores it until the marker points at it."""
        return f"{STAGED_PREFIX}{step}"

    def resharded_name(self, step: int) -> str:
        """``.mtc-resharded-<step>``: an elastic restore's staged step (``prefetch.resharded``), named apart
        from ``staged_name`` so that nothing takes it for this node's own copy of ``step``."""
        return f"{RESHARDED_PREFIX}{step}"

    def step_names(self, step: int) -> tuple[str, ...]:
        """``<step>`` (a commit), the adopted marker's name and ``.mtc-staged-<step>``."""
        return tuple(dict.fromkeys((str(step), self.adopted_name(step), self.staged_name(step))))

    def steps_restored_instead(self, scan: StepScan, step: int | None) -> list[int]:
        """The steps of ``scan`` the job could restore instead of ``step`` (every one when None): a job
        that looks for the newest step it finds (Orbax, NeMo) would take any committed, refused or
        uncommitted name newer than it (NeMo loads a ``step=<G>/`` it has not marked unfinished)."""
        return sorted({s for s in scan.committed + scan.refused + scan.uncommitted if step is None or s > step})

    # -- the hand-shake ----------------------------------------------------------------------------

    def read_config(self, local_dir: str) -> ConfigFile | None:
        """The job's ``replicator.yaml`` as read now, or None while it has not written one.

        Raises:
          pod_files.UnsafeEntry: it is not a regular file (a symlink, a FIFO) or is over 64 KiB.
        """
        with pod_files.open_dir(local_dir) as fd:
            found = pod_files.read_small(fd, REPLICATOR_FILE, MAX_REPLICATOR_YAML_BYTES)
        return None if found is None else ConfigFile(found[0], file_cache.key_of(found[1]))

    def consume_config(self, local_dir: str) -> None:
        """Deletes ``replicator.yaml``: the job waits for that before it goes on (or reads ``.failed``)."""
        with pod_files.open_dir(local_dir) as fd:
            pod_files.remove(fd, REPLICATOR_FILE)

    def clear_previous_pod(self, local_dir: str) -> None:
        """Removes what a previous pod's protocol run left: the ``handshake_files`` (its unconsumed
        ``replicator.yaml``: the job waits for it to vanish before writing its own), markers,
        temporary files of interrupted writes, and saves it never committed (``unfinished_save``: a
        pod killed mid-save leaves up to a whole shard that no process will ever finish, space the
        sizing rule does not have)."""
        with pod_files.open_dir(local_dir) as fd:
            for name in self.handshake_files:
                pod_files.remove(fd, name)
            pod_files.sweep_temp_files(fd)
            for name, status in pod_files.names(fd):
                # A symlink is no save: under a step's name it is a restore marker the job took.
                if self.unfinished_save.match(name) and not stat.S_ISLNK(status.st_mode):
                    pod_files.remove(fd, name)
        self.remove_markers(local_dir)

    # -- restore markers ---------------------------------------------------------------------------

    def write_restore_marker(self, local_dir: str, job: str, step: int, rank: int, resharded: bool = False) -> str:
        """Points a restore marker at the staged step (``resharded``: an elastic restore's,
        ``resharded_name``) by a relative symlink. Returns the marker's path.

        Raises:
          FileNotFoundError: the step is not staged (see ``staged_name``).
        """
        name = restore_marker_name(job, step, rank)
        staged = self.resharded_name(step) if resharded else self.staged_name(step)
        with pod_files.open_dir(local_dir) as fd:
            if not pod_files.is_dir(fd, staged):
                raise FileNotFoundError(f"step {step} is not staged at {os.path.join(local_dir, staged)}")
            self._before_marker(fd, step)
            # Relative: the pod sees this dir at its own mountPath.
            pod_files.write_symlink(fd, name, staged)
        return os.path.join(local_dir, name)

    def write_fresh_start_marker(self, local_dir: str, job: str, rank: int) -> str:
        """Writes the zero-byte ``s0`` marker: no checkpoint exists, start from scratch. Returns its path."""
        name = restore_marker_name(job, 0, rank)
        with pod_files.open_dir(local_dir) as fd:
            self._before_marker(fd, None)
            pod_files.write_atomic(fd, name, b"")
        return os.path.join(local_dir, name)

    def _before_marker(self, dir_fd: int, step: int | None) -> None:
        """What a protocol writes just before the marker (``step`` None: a fresh start); nothing here."""

    def remove_markers(self, local_dir: str) -> None:
        """Removes restore markers a previous incarnation left unconsumed."""
        with pod_files.open_dir(local_dir) as fd:
            for name, _ in pod_files.names(fd):
                if _RESTORE_MARKER.match(name):
                    pod_files.remove(fd, name)

    # -- the error files ---------------------------------------------------------------------------

    def report_error(self, local_dir: str, log_dir: str, message: str) -> None:
        """Appends a recoverable error to ``replicator.errors``; the job logs it and deletes the file.

        Args:
          local_dir: the client dir.
          log_dir: an agent-owned directory of the same job, where the file's content is kept.
        """
        _report(local_dir, log_dir, ERRORS_FILE, message)

    def report_failure(self, local_dir: str, log_dir: str, message: str) -> None:
        """Writes ``replicator.failed``: the job raises with this message."""
        _report(local_dir, log_dir, FAILED_FILE, message)


def _copy(scan: StepScan) -> StepScan:
    return StepScan(
        list(scan.committed), list(scan.staged), list(scan.refused), list(scan.uncommitted)
    )  # the caller's own lists
