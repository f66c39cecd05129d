"""The job's half of the ``pytorch.distributed`` file protocol (no torch import: stdlib and PyYAML only).

The file names and the order of the handshake follow Google's Resiliency library
(``AI-Hypercomputer/resiliency``, ``resiliency/high_scale_ckpt_utils.py``), which NeMo/Megatron jobs on the managed
product use; our client adds only optional keys to ``replicator.yaml``. Only a node's local rank 0 calls
:func:`handshake`; the step layout of a save is :func:`tmp_step_name` / :func:`step_name` / :func:`rank_dir_name`.

Every name in the client directory is resolved against one directory file descriptor, opened without following
symlinks; the only symlink this module follows is the restore marker the agent made (renamed to ``step=<step>``).
Everything read from the directory is bounded (:data:`MAX_CONTROL_FILE_BYTES`) and parsed with ``yaml.safe_load``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar, overload

import yaml

log = logging.getLogger(__name__)

_T = TypeVar("_T")

FRAMEWORK = "pytorch.distributed"
# The Resiliency library's names (high_scale_ckpt_utils.py).
REPLICATOR_FILE = "replicator.yaml"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
PRERESTORE_FILE = "replicator.prerestore"
MARKER_SUFFIX = ".restore"
RESTORED_STEP_PREFIX = "step="
# Our step layout (the agent checks it): <local>/<S>.tmp/rank-<r>-of-<W>/.metadata, committed by renaming to <S>.
TMP_STEP_SUFFIX = ".tmp"
METADATA_FILE = ".metadata"

MAX_CONTROL_FILE_BYTES = 64 * 1024
"""The largest ``replicator.prerestore`` / ``.errors`` / ``.failed`` read, in bytes (the rest is cut off)."""
DEFAULT_TIMEOUT_S = 300.0
"""Each wait of the handshake (consumed ``replicator.yaml``, prerestore, marker), in seconds, as in Resiliency."""

_MARKER_RE = re.compile(
    r"^(?P<job>[A-Za-z0-9][A-Za-z0-9._-]{0,252})-s(?P<step>[0-9]{1,18})"
    r"-n(?P<node>[0-9]{1,9})-w(?P<worker>[0-9]{1,9})\.restore$"
)
_TMP_STEP_RE = re.compile(r"^[0-9]{1,18}\.tmp$")
_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class ReplicatorFailed(RuntimeError):
    """The agent refused the job: ``replicator.failed`` appeared; the message holds its text (bounded)."""


class ProtocolError(RuntimeError):
    """A file the agent wrote is malformed (prerestore YAML, a marker of the wrong kind)."""


@dataclasses.dataclass(frozen=True)
class NodeTopology:
    """Where this process sits, from torchrun's environment.

    Attributes:
        node_rank: ``NODE_RANK``, else ``GROUP_RANK`` (torchrun with c10d rendezvous sets only the latter).
        nodes: ``NNODES``, else ``WORLD_SIZE // LOCAL_WORLD_SIZE``.
        local_rank: ``LOCAL_RANK`` (0 when unset: a single process).
        local_world_size: ``LOCAL_WORLD_SIZE``, the W of ``rank-<r>-of-<W>`` (1 when unset).
    """

    node_rank: int
    nodes: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node rank {self.node_rank} is not in range(nodes={self.nodes})")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local rank {self.local_rank} is not in range(local world size={self.local_world_size})")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NodeTopology:
        """Reads torchrun's variables from ``env`` (e.g. ``os.environ``).

        Raises:
            ValueError: neither ``NODE_RANK`` nor ``GROUP_RANK`` is set, a value is not an integer, or a rank is out
                of range.
        """

        @overload
        def integer(name: str, default: int) -> int: ...

        @overload
        def integer(name: str, default: None = None) -> int | None: ...

        def integer(name: str, default: int | None = None) -> int | None:
            value = env.get(name)
            if value is None or value == "":
                return default
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None

        local_world_size = integer("LOCAL_WORLD_SIZE", 1)
        node_rank = integer("NODE_RANK")
        if node_rank is None:
            node_rank = integer("GROUP_RANK")
        if node_rank is None:
            raise ValueError("neither NODE_RANK nor GROUP_RANK is set: run under torchrun --node-rank=<JobSet index>")
        nodes = integer("NNODES")
        if nodes is None:
            nodes = integer("WORLD_SIZE", local_world_size) // local_world_size
        return cls(
            node_rank=node_rank, nodes=nodes, local_rank=integer("LOCAL_RANK", 0), local_world_size=local_world_size
        )


@dataclasses.dataclass(frozen=True)
class ReplicatorConfig:
    """The content of ``replicator.yaml``; Resiliency's keys plus our optional ones.

    Attributes:
        job_name: ``job-name``.
        node_rank: ``node-rank``, this node's rank in ``range(nodes)``.
        nodes: ``nodes``.
        peers_per_node: ``peers-per-node`` (>= 1), how many peers hold a copy of this node's steps.
        backup_interval_minutes: ``backup-interval-minutes``; exactly one of it and ``backup_interval_steps``.
        backup_interval_steps: ``backup-interval-steps`` (ours).
        peer_ranks: ``peer-ranks``, optional.
        assume_data_parallelism: ``assume-data-parallelism`` (ours): how many nodes hold identical steps; divides
            ``nodes``.
        workers_per_node: ``workers-per-node`` (ours): the local world size W.
    """

    job_name: str
    node_rank: int
    nodes: int
    peers_per_node: int = 1
    backup_interval_minutes: float | None = None
    backup_interval_steps: int | None = None
    peer_ranks: tuple[int, ...] | None = None
    assume_data_parallelism: int | None = None
    workers_per_node: int | None = None

    def __post_init__(self) -> None:
        if not _JOB_NAME_RE.match(self.job_name):
            raise ValueError(f"job name {self.job_name!r} must match {_JOB_NAME_RE.pattern}")
        if self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node rank {self.node_rank} is not in range(nodes={self.nodes})")
        if self.peers_per_node < 1:
            raise ValueError(f"peers_per_node must be >= 1, not {self.peers_per_node}")
        if (self.backup_interval_minutes is None) == (self.backup_interval_steps is None):
            raise ValueError("give exactly one of backup_interval_minutes and backup_interval_steps")
        if self.backup_interval_minutes is not None and not self.backup_interval_minutes > 0:
            raise ValueError(f"backup_interval_minutes must be > 0, not {self.backup_interval_minutes}")
        if self.backup_interval_steps is not None and self.backup_interval_steps < 1:
            raise ValueError(f"backup_interval_steps must be >= 1, not {self.backup_interval_steps}")
        if self.assume_data_parallelism is not None and (
            self.assume_data_parallelism < 1 or self.nodes % self.assume_data_parallelism
        ):
            raise ValueError(f"assume_data_parallelism={self.assume_data_parallelism} must divide nodes={self.nodes}")
        if self.workers_per_node is not None and self.workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1, not {self.workers_per_node}")
        if self.peer_ranks is not None and any(not 0 <= r < self.nodes for r in self.peer_ranks):
            raise ValueError(f"peer_ranks {list(self.peer_ranks)} must lie in range(nodes={self.nodes})")

    def to_yaml(self) -> str:
        """The file's text: Resiliency's keys in its order, then ours; keys left unset are not written."""
        data: dict[str, object] = {
            "job-name": self.job_name,
            "framework": FRAMEWORK,
            "node-rank": self.node_rank,
            "nodes": self.nodes,
            "peers-per-node": self.peers_per_node,
        }
        if self.backup_interval_minutes is not None:
            data["backup-interval-minutes"] = self.backup_interval_minutes
        if self.peer_ranks is not None:
            data["peer-ranks"] = list(self.peer_ranks)
        if self.backup_interval_steps is not None:
            data["backup-interval-steps"] = self.backup_interval_steps
        if self.assume_data_parallelism is not None:
            data["assume-data-parallelism"] = self.assume_data_parallelism
        if self.workers_per_node is not None:
            data["workers-per-node"] = self.workers_per_node
        text: str = yaml.safe_dump(data, default_flow_style=False, sort_keys=False)
        return text


@dataclasses.dataclass(frozen=True)
class Waits:
    """The handshake's bounds, in seconds, and the polling period. ``sleep``/``clock`` are injectable for tests."""

    consumed_s: float = DEFAULT_TIMEOUT_S
    prerestore_s: float = DEFAULT_TIMEOUT_S
    marker_s: float = DEFAULT_TIMEOUT_S
    poll_s: float = 0.05
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What the handshake found.

    Attributes:
        step: the step to load, or None to start fresh (prerestore ``{}`` / ``restore-step: 0``, a step-0 marker).
        directory: ``<local>/step=<step>`` (a symlink the agent made, renamed by us), or None when fresh.
    """

    step: int | None
    directory: Path | None


def step_name(step: int) -> str:
    """``<step>``: a committed step's directory name."""
    return str(_check_step(step))


def tmp_step_name(step: int) -> str:
    """``<step>.tmp``: where a step is written before local rank 0 commits it by renaming."""
    return f"{_check_step(step)}{TMP_STEP_SUFFIX}"


def rank_dir_name(local_rank: int, local_world_size: int) -> str:
    """``rank-<r>-of-<W>``: one local rank's self-contained DCP checkpoint inside a step."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is not in range({local_world_size})")
    return f"rank-{local_rank}-of-{local_world_size}"


def restored_step_name(step: int) -> str:
    """``step=<step>``: what the client renames the restore marker to (Resiliency's name)."""
    return f"{RESTORED_STEP_PREFIX}{_check_step(step)}"


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise ValueError(f"a step is an int in [0, 1e18), not {step!r}")
    return step


@contextlib.contextmanager
def open_dir(path: str | os.PathLike[str]) -> Iterator[int]:
    """Opens ``path`` as a directory file descriptor without following a final symlink; closes it on exit.

    Raises:
        NotADirectoryError / OSError (ELOOP): ``path`` is not a directory, or is a symlink.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def exists(dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists in the directory (a symlink counts: it is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def read_small_file(dir_fd: int, name: str, limit: int = MAX_CONTROL_FILE_BYTES) -> str | None:
    """Reads at most ``limit`` bytes of a regular file ``name``, decoded as UTF-8 (errors replaced).

    Returns:
        The text, or None if the file does not exist.

    Raises:
        ProtocolError: ``name`` is a symlink, a directory or anything but a regular file.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symlink
        raise ProtocolError(f"{name} is not a regular file: {err}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise ProtocolError(f"{name} is not a regular file")
        return file.read(limit).decode("utf-8", errors="replace")


def unlink_quietly(dir_fd: int, name: str) -> None:
    """Removes ``name`` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def check_agent_files(dir_fd: int) -> None:
    """Logs and deletes ``replicator.errors``; raises on ``replicator.failed`` (the Resiliency library's handling).

    Raises:
        ReplicatorFailed: ``replicator.failed`` exists; its text (bounded) is the message. The file is deleted
            first, as Resiliency does, so that a restarted container tries again.
    """
    errors = read_small_file(dir_fd, ERRORS_FILE)
    if errors is not None:
        log.error("replicator errors: %s", errors.strip())
        unlink_quietly(dir_fd, ERRORS_FILE)
    failed = read_small_file(dir_fd, FAILED_FILE)
    if failed is not None:
        unlink_quietly(dir_fd, FAILED_FILE)
        raise ReplicatorFailed(f"the node agent refused the job ({FAILED_FILE}): {failed.strip()}")


def remove_stale_tmp_steps(dir_fd: int) -> list[str]:
    """Removes every ``<step>.tmp`` directory (an unfinished save of an earlier incarnation).

    Symlinks and non-directories with that name are left alone. Returns the names removed, sorted.
    """
    removed = []
    for name in sorted(os.listdir(dir_fd)):
        if not _TMP_STEP_RE.match(name):
            continue
        if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            continue
        # rmtree with dir_fd walks by file descriptors and never follows a symlink inside the tree.
        shutil.rmtree(name, dir_fd=dir_fd)
        removed.append(name)
    return removed


def _wait(
    what: str, timeout_s: float, waits: Waits, dir_fd: int, ready: Callable[[], _T | None], check: bool = True
) -> _T:
    """Polls ``ready()`` until it returns non-None; with ``check``, looks at the agent's files before each poll."""
    deadline = waits.clock() + timeout_s
    while True:
        if check:
            check_agent_files(dir_fd)
        result = ready()
        if result is not None:
            return result
        if waits.clock() >= deadline:
            raise TimeoutError(
                f"{what} within {timeout_s:g} s: is the node agent running, and is this volume's "
                f"framework attribute {FRAMEWORK!r}?"
            )
        waits.sleep(waits.poll_s)


def write_replicator_config(dir_fd: int, config: ReplicatorConfig, waits: Waits) -> None:
    """Waits for an earlier ``replicator.yaml`` to vanish, writes this one whole (tmp + rename), waits for the
    agent to consume (delete) it.

    Raises:
        TimeoutError: an old file did not vanish, or the new one was not consumed, within ``waits.consumed_s``.
        ReplicatorFailed: ``replicator.failed`` appeared.
    """
    # Files of an earlier run (a restarted container) are not this run's answer: look only once ours is written.
    _wait(
        f"an earlier {REPLICATOR_FILE} was not consumed",
        waits.consumed_s,
        waits,
        dir_fd,
        lambda: None if exists(dir_fd, REPLICATOR_FILE) else True,
        check=False,
    )
    tmp = f".{REPLICATOR_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(config.to_yaml())
            file.flush()
            os.fsync(file.fileno())
        os.rename(tmp, REPLICATOR_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_quietly(dir_fd, tmp)
        raise
    log.info("wrote %s: %s", REPLICATOR_FILE, config)
    _wait(
        f"the node agent did not consume {REPLICATOR_FILE}",
        waits.consumed_s,
        waits,
        dir_fd,
        lambda: None if exists(dir_fd, REPLICATOR_FILE) else True,
    )


def parse_prerestore(text: str) -> int:
    """The step of a ``replicator.prerestore`` file: ``restore-step: N``, or ``{}`` / empty for 0 (fresh).

    Raises:
        ProtocolError: not YAML, not a mapping, or ``restore-step`` is not a non-negative integer.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ProtocolError(f"{PRERESTORE_FILE} is not YAML: {err}") from None
    if data is None:
        return 0
    if not isinstance(data, dict):
        raise ProtocolError(f"{PRERESTORE_FILE} is not a mapping: {text[:200]!r}")
    step = data.get("restore-step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise ProtocolError(f"{PRERESTORE_FILE}: restore-step must be a non-negative integer, not {step!r}")
    return step


def wait_prerestore(dir_fd: int, waits: Waits) -> int:
    """Waits for ``replicator.prerestore`` and returns its step (0: fresh). The file is left for the agent.

    Raises:
        TimeoutError: no file within ``waits.prerestore_s``. ProtocolError: a malformed file.
        ReplicatorFailed: ``replicator.failed`` appeared.
    """

    def ready() -> int | None:
        text = read_small_file(dir_fd, PRERESTORE_FILE)
        return None if text is None else parse_prerestore(text)

    return int(_wait(f"no {PRERESTORE_FILE}", waits.prerestore_s, waits, dir_fd, ready))


def find_marker(dir_fd: int, node_rank: int) -> tuple[str, int] | None:
    """The restore marker for this node: ``(name, step)``, or None. Names not matching the strict marker pattern,
    or naming another node, are ignored; if several match, the highest step wins. The job part is not compared:
    the agent names markers after the volume's job key (a JobSet's ``<jobset>-<replicatedJob>``), which need not
    be ``job-name``; the directory is the job's own."""
    found = []
    for name in os.listdir(dir_fd):
        match = _MARKER_RE.match(name)
        if match and int(match["node"]) == node_rank:
            found.append((int(match["step"]), name))
    if not found:
        return None
    step, name = max(found)
    return name, step


def claim_marker(dir_fd: int, local_dir: Path, name: str, step: int) -> RestoreResult:
    """Acts on a marker: step 0 (a zero-byte regular file) means fresh and is left alone; otherwise the marker must
    be a symlink to a directory and is renamed to ``step=<step>`` in the same directory.

    Raises:
        ProtocolError: the marker is of the wrong kind (a step-0 symlink, a step-N regular file, a dangling link).
    """
    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    if step == 0:
        if not stat.S_ISREG(mode):
            raise ProtocolError(f"the step-0 marker {name} is not a regular file")
        return RestoreResult(step=None, directory=None)
    if not stat.S_ISLNK(mode):
        raise ProtocolError(f"the restore marker {name} is not a symlink to the staged step")
    target = os.readlink(name, dir_fd=dir_fd)
    try:
        is_dir = stat.S_ISDIR(os.stat(name, dir_fd=dir_fd).st_mode)  # the one symlink we follow: the agent's
    except FileNotFoundError:
        is_dir = False
    if not is_dir:
        raise ProtocolError(f"the restore marker {name} -> {target} does not point to a directory")
    new_name = restored_step_name(step)
    os.rename(name, new_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    log.info("restore marker %s -> %s renamed to %s", name, target, new_name)
    return RestoreResult(step=step, directory=local_dir / new_name)


def handshake(local_dir: str | os.PathLike[str], config: ReplicatorConfig, waits: Waits = Waits()) -> RestoreResult:
    """The whole handshake of one node's local rank 0, in Resiliency's order.

    1. stale ``<S>.tmp`` directories are removed; 2. ``replicator.yaml`` is written and consumed;
    3. ``replicator.prerestore`` is read; 4. the marker ``<job>-s<step>-n<node>-w<worker>.restore`` is claimed.

    Args:
        local_dir: the pod's mount of the node's ramdisk (e.g. ``/local``); it must be a directory, not a symlink.
        config: this node's ``replicator.yaml``.
        waits: bounds of each wait (300 s each by default).

    Returns:
        The step to load and ``<local>/step=<step>``, or ``RestoreResult(None, None)`` to start fresh.

    Raises:
        ReplicatorFailed: ``replicator.failed`` appeared at any point.
        TimeoutError: a wait ran out; the message names which.
        ProtocolError: a malformed prerestore file or marker.
    """
    local = Path(local_dir)
    with open_dir(local) as dir_fd:
        removed = remove_stale_tmp_steps(dir_fd)
        if removed:
            log.info("removed unfinished saves of an earlier run: %s", removed)
        write_replicator_config(dir_fd, config, waits)
        prerestore_step = wait_prerestore(dir_fd, waits)
        marker = _wait(
            f"no restore marker <job>-s<step>-n{config.node_rank}-w<worker>{MARKER_SUFFIX}",
            waits.marker_s,
            waits,
            dir_fd,
            lambda: find_marker(dir_fd, config.node_rank),
        )
        name, step = marker
        if step != prerestore_step:
            log.warning(
                "%s announced step %d, the marker %s names step %d: the marker wins",
                PRERESTORE_FILE,
                prerestore_step,
                name,
                step,
            )
        return claim_marker(dir_fd, local, name, step)
