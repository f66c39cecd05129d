"""``CheckpointManager``: torch.distributed.checkpoint saves and restores through the node's ramdisk.

Every local rank r of W writes its own self-contained DCP checkpoint (``no_dist=True``) into
``<local>/<S>.tmp/rank-<r>-of-<W>/``; local rank 0 commits the step by renaming ``<S>.tmp`` to ``<S>`` once every
rank's ``.metadata`` exists. The node agent replicates, backs up and restores committed steps; a restore arrives
as ``<local>/step=<S>/`` (see :mod:`mtc_torch.protocol` for the handshake, after Google's Resiliency library).

A save first copies the state into host buffers kept across saves (pinned next to a GPU:
:class:`mtc_torch.staging.HostStager`); only that copy blocks training. The files are then written from those
buffers by several threads (:class:`mtc_torch.storage.DeterministicWriter`), and a restore reads them by several
threads straight into the destination tensors (:class:`mtc_torch.reader.StepReader`). A restore into another
shape (local world size, node count or mesh) reads the staged step through the same reader, resharded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from mtc_torch import protocol, step_layout
from mtc_torch.coverage import PartialRestoreError
from mtc_torch.protocol import NodeTopology, ReplicatorConfig, RestoreResult, Waits
from mtc_torch.reader import StepReader
from mtc_torch.staging import HostStager
from mtc_torch.storage import DEFAULT_FILES, DeterministicWriter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Restore:
    """One node's local rank 0 handshake result, as gathered by every rank."""

    node_rank: int
    step: int | None
    directory: str | None


class CheckpointManager:
    """Saves and restores a state dict through the node agent's ramdisk (the ``pytorch.distributed`` protocol).

    Every process of the job builds one; each node's local rank 0 speaks to the agent. With more than one local
    rank, ``torch.distributed`` must be initialized before :meth:`load` (the other ranks learn the step from it).

    Args:
        local_dir: the pod's mount of the node's ramdisk (e.g. ``/local``).
        job_name: ``job-name`` of ``replicator.yaml`` and the prefix of restore markers.
        backup_interval_minutes: ``backup-interval-minutes``; exactly one of it and ``backup_interval_steps``.
        backup_interval_steps: ``backup-interval-steps`` (our extension).
        peers_per_node: ``peers-per-node`` (>= 1).
        peer_ranks: optional ``peer-ranks``.
        assume_data_parallelism: optional ``assume-data-parallelism``: how many nodes hold identical steps.
        env: where the topology is read (``NODE_RANK``/``GROUP_RANK``, ``NNODES``/``WORLD_SIZE``,
            ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); ``os.environ`` by default.
        waits: bounds of the handshake's waits, in seconds (300 s each by default).
        commit_timeout_s: how long local rank 0 waits for the other local ranks' ``.metadata``, in seconds.
        io_threads: threads that write a save's files and read a restore's (None: the CPUs this process may use,
            shared among the node's local ranks, between 2 and 16).
        pinned_memory_limit_bytes: the most host memory the save's staging buffers may pin, in bytes (None: no
            limit; they hold one copy of this rank's GPU tensors). Past it, tensors are staged in pageable memory,
            which is about 50x slower to copy out of a GPU, with a warning.
        files_per_rank: data files per rank and step; keep it equal on data-parallel replicas (their steps must be
            byte-identical).

    Raises:
        ValueError: a bad argument or environment (no ``NODE_RANK``/``GROUP_RANK``, a rank out of range).
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        job_name: str,
        *,
        backup_interval_minutes: float | None = None,
        backup_interval_steps: int | None = None,
        peers_per_node: int = 1,
        peer_ranks: list[int] | None = None,
        assume_data_parallelism: int | None = None,
        env: Mapping[str, str] | None = None,
        waits: Waits = Waits(),
        commit_timeout_s: float = protocol.DEFAULT_TIMEOUT_S,
        io_threads: int | None = None,
        pinned_memory_limit_bytes: int | None = None,
        files_per_rank: int = DEFAULT_FILES,
    ) -> None:
        self.local_dir = Path(local_dir)
        self.topology = NodeTopology.from_env(os.environ if env is None else env)
        self.config = ReplicatorConfig(
            job_name=job_name,
            node_rank=self.topology.node_rank,
            nodes=self.topology.nodes,
            peers_per_node=peers_per_node,
            backup_interval_minutes=backup_interval_minutes,
            backup_interval_steps=backup_interval_steps,
            peer_ranks=None if peer_ranks is None else tuple(peer_ranks),
            assume_data_parallelism=assume_data_parallelism,
            workers_per_node=self.topology.local_world_size,
        )
        self.waits = waits
        self.commit_timeout_s = commit_timeout_s
        self.io_threads = io_threads or default_io_threads(self.topology.local_world_size)
        if self.io_threads < 1 or files_per_rank < 1:
            raise ValueError(f"io_threads and files_per_rank must be >= 1, got {self.io_threads} and {files_per_rank}")
        self.files_per_rank = files_per_rank
        self._stager = HostStager(pinned_memory_limit_bytes)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-torch-save")
        self._pending: concurrent.futures.Future[int] | None = None
        self._lock = threading.Lock()

    # -- restore -------------------------------------------------------------------------------------

    def load(self, state_dict: dict[str, Any]) -> int | None:
        """Runs the handshake and loads the restored step into ``state_dict`` in place.

        Call it once, before the first save, on every rank (it is collective when ``torch.distributed`` is
        initialized). ``state_dict`` is what ``dcp.load`` takes: tensors, DTensors and ``Stateful`` objects.

        Returns:
            The restored step, or None when the job starts fresh.

        Raises:
            ReplicatorFailed: the agent refused the job (``replicator.failed``).
            TimeoutError: the agent did not answer within the handshake's bounds.
            ProtocolError: a malformed prerestore file or marker.
            PartialRestoreError: the staged step does not store every element ``state_dict`` asks for (its
                sharding differs from the saving one and the ranks holding the rest were not staged on this node);
                raised before any of ``state_dict`` is changed.
            ValueError: the staged step is malformed (:mod:`mtc_torch.step_layout`), or nodes got different steps.
            RuntimeError: several local ranks but ``torch.distributed`` is not initialized.
        """
        mine = self._handshake_on_local_rank_0()
        restore = self._share(mine)
        if restore.step is None:
            log.info("node %d: starting fresh", self.topology.node_rank)
            return None
        assert restore.directory is not None
        step_dir = Path(restore.directory)
        own = self._own_rank_dir(step_dir)
        if own is not None:
            try:  # the saving shape: this rank's own directory holds what it asks for, read as before
                self._load_from(StepReader(step_dir / own, threads=self.io_threads), state_dict)
                log.info(
                    "node %d local rank %d: restored step %d from %s",
                    self.topology.node_rank,
                    self.topology.local_rank,
                    restore.step,
                    step_dir / own,
                )
                return restore.step
            except PartialRestoreError:  # another mesh: other ranks' directories hold the rest; nothing was read
                pass
        reader = StepReader(step_dir, threads=self.io_threads, prefer=own)
        self._load_from(reader, state_dict)
        log.info(
            "node %d local rank %d: restored step %d resharded from %s (%d rank directories)",
            self.topology.node_rank,
            self.topology.local_rank,
            restore.step,
            step_dir,
            len(reader.rank_dirs()),
        )
        return restore.step

    @staticmethod
    def _load_from(reader: StepReader, state_dict: dict[str, Any]) -> None:
        reader.read_metadata()  # a malformed step raises its own ValueError here (within dcp.load: a message)
        try:
            dcp.load(state_dict, storage_reader=reader, no_dist=True)
        except CheckpointException as failed:
            # DCP wraps what the reader raised in a BaseException; a partial restore reaches the trainer as itself.
            for error, _ in failed.failures.values():
                if isinstance(error, PartialRestoreError):
                    raise error from failed
            raise

    def _own_rank_dir(self, step_dir: Path) -> str | None:
        """This process's own rank directory in ``step_dir`` (relative), if the step was saved with this local
        world size: ``rank-<r>-of-<W>``, or ``node-<n>-of-<N>/rank-<r>-of-<W>`` in a multi-node step."""
        name = protocol.rank_dir_name(self.topology.local_rank, self.topology.local_world_size)
        if (step_dir / name / protocol.METADATA_FILE).is_file():
            return name
        for rank_dir in step_layout.rank_dirs(step_dir):
            if rank_dir.node == self.topology.node_rank and rank_dir.relative.endswith(f"/{name}"):
                return rank_dir.relative
        return None

    def _handshake_on_local_rank_0(self) -> _Restore | None:
        if self.topology.local_rank != 0:
            return None
        result: RestoreResult = protocol.handshake(self.local_dir, self.config, self.waits)
        return _Restore(
            self.topology.node_rank, result.step, None if result.directory is None else str(result.directory)
        )

    def _share(self, mine: _Restore | None) -> _Restore:
        """Every rank gets its node's local-rank-0 result; all nodes must agree on the step."""
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed:
            if self.topology.local_world_size > 1:
                raise RuntimeError(
                    f"{self.topology.local_world_size} local ranks need torch.distributed initialized "
                    "before load(): the other ranks learn the restored step from local rank 0"
                )
            assert mine is not None
            return mine
        gathered: list[_Restore | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results = [r for r in gathered if r is not None]
        steps = {r.node_rank: r.step for r in results}
        if len(set(steps.values())) > 1:
            raise ValueError(f"nodes were told to restore different steps (node rank: step, None = fresh): {steps}")
        for result in results:
            if result.node_rank == self.topology.node_rank:
                return result
        raise RuntimeError(
            f"no local rank 0 reported for node rank {self.topology.node_rank}: "
            f"is LOCAL_RANK/NODE_RANK consistent across processes? (got nodes {sorted(steps)})"
        )

    # -- save ----------------------------------------------------------------------------------------

    def save(self, state_dict: dict[str, Any], step: int) -> None:
        """Saves ``step`` and returns after the commit (on local rank 0: after renaming ``<S>.tmp`` to ``<S>``).

        Waits for a pending :meth:`async_save` first. Every local rank must call it with the same step.

        Raises:
            FileExistsError: ``<local>/<S>`` is already committed (a step saved twice).
            TimeoutError: local rank 0 did not see every local rank's ``.metadata`` within ``commit_timeout_s``.
        """
        self.wait()
        rank_dir = self._prepare(step)
        plain = _plain(state_dict)
        # The trainer waits anyway: a state in host memory is written as it is, without a copy.
        self._write(self._stager.stage(plain) if _on_a_gpu(plain) else plain, rank_dir, step)

    def async_save(
        self, state_dict: dict[str, Any], step: int, *, wait_for_staging: bool = True
    ) -> concurrent.futures.Future[int]:
        """Saves ``step`` in the background; blocks only while the state is copied into host memory.

        Waits for the previous pending save first (one save in flight at a time).

        Args:
            state_dict: what :meth:`save` takes.
            step: the step.
            wait_for_staging: return once the copy is done, so the state may be changed at once. False: return as
                soon as the copy out of GPU memory is queued (on its own CUDA stream, after the work already queued);
                the trainer then calls :meth:`wait_for_staging` before it next changes the state, such as before
                ``optimizer.step()`` (TorchTitan's ``async_with_pinned_mem``). A CPU tensor is copied before the call
                returns either way.

        Returns:
            A future that resolves to ``step`` after the commit (on local rank 0: after the rename), or holds the
            error :meth:`save` would have raised.
        """
        self.wait()
        rank_dir = self._prepare(step)
        staged = self._stager.stage(_plain(state_dict))
        if wait_for_staging:
            self._stager.wait()

        def finish() -> int:
            self._write(staged, rank_dir, step)
            return step

        with self._lock:
            self._pending = self._executor.submit(finish)
            return self._pending

    def wait_for_staging(self) -> None:
        """Blocks until the copy of the last save's state is done; from then on the state may be changed."""
        self._stager.wait()

    def wait(self) -> None:
        """Waits for the pending :meth:`async_save`, if any, and raises its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for the pending save, stops the background thread and frees the staging buffers."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()

    def _write(self, staged: dict[str, Any], rank_dir: Path, step: int) -> None:
        self._stager.wait()
        writer = DeterministicWriter(rank_dir, files=self.files_per_rank, threads=self.io_threads)
        dcp.save(staged, storage_writer=writer, no_dist=True)
        self._commit(step)

    def _prepare(self, step: int) -> Path:
        if (self.local_dir / protocol.step_name(step)).exists():
            raise FileExistsError(f"step {step} is already committed in {self.local_dir}: a step is saved once")
        rank_dir = (
            self.local_dir
            / protocol.tmp_step_name(step)
            / protocol.rank_dir_name(self.topology.local_rank, self.topology.local_world_size)
        )
        rank_dir.mkdir(parents=True, exist_ok=True)
        return rank_dir

    def _commit(self, step: int) -> None:
        """On local rank 0: waits for every ``rank-*-of-W/.metadata``, then renames ``<S>.tmp`` to ``<S>``."""
        if self.topology.local_rank != 0:
            return
        world = self.topology.local_world_size
        tmp = self.local_dir / protocol.tmp_step_name(step)
        needed = [tmp / protocol.rank_dir_name(r, world) / protocol.METADATA_FILE for r in range(world)]
        deadline = time.monotonic() + self.commit_timeout_s
        while True:
            missing = [str(p.parent.name) for p in needed if not p.is_file()]
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"step {step}: local ranks {missing} wrote no {protocol.METADATA_FILE} within "
                    f"{self.commit_timeout_s:g} s; {tmp} stays uncommitted"
                )
            time.sleep(self.waits.poll_s)
        with protocol.open_dir(self.local_dir) as dir_fd:
            os.rename(tmp.name, protocol.step_name(step), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        log.info("node %d: committed step %d", self.topology.node_rank, step)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_io_threads(local_world_size: int) -> int:
    """The CPUs this process may use, shared among ``local_world_size`` ranks, between 2 and 16: 16 threads read
    and write tmpfs at about 25 GB/s on an H200 host, 8 at about 16 GB/s."""
    return max(2, min(16, len(os.sched_getaffinity(0)) // max(1, local_world_size)))


def _on_a_gpu(value: Any) -> bool:
    """Whether any tensor in ``value`` (nested dicts, lists and tuples) is in GPU memory."""
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, Mapping):
        return any(_on_a_gpu(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_on_a_gpu(v) for v in value)


def _plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each ``Stateful`` value replaced by its ``state_dict()``, as ``dcp.save`` does."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}
