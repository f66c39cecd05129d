"""The ``pytorch.distributed`` file protocol: PyTorch jobs that save with ``torch.distributed.checkpoint``.

The job's side is Google's Resiliency library (``AI-Hypercomputer/resiliency``,
``resiliency/high_scale_ckpt_utils.py``, for NeMo/Megatron) or our client ``mtc_torch``; the
managed product's replicator calls the framework ``pytorch.distributed``. The files, in the
client dir (the pod's local checkpoint directory):

- ``replicator.yaml``: the job writes ``job-name``, ``framework: pytorch.distributed``,
  ``node-rank`` (its ``NODE_RANK``), ``nodes`` (``NNODES``), ``peers-per-node``,
  ``backup-interval-minutes`` and optionally ``peer-ranks``; ``mtc_torch`` adds
  ``assume-data-parallelism``, ``workers-per-node`` and ``backup-interval-steps`` (the managed
  replicator knows the first two). We validate and consume it by deleting it.
- ``replicator.prerestore``: we write ``restore-step: <step>`` (``{}``: nothing to restore) before
  the marker; the job waits for it (300 s) before it waits for the marker.
- ``<job>-s<step>-n<rank>-w0.restore``: the marker, as for Orbax (a symlink to the staged step, or a
  zero-byte file with step 0: start fresh). The job renames it to ``step=<step>`` and loads from there.
- ``replicator.errors`` / ``replicator.failed``: as for Orbax (the job logs / raises).
- ``<step>/`` appearing (renamed in whole): a committed save of the node. ``mtc_torch`` writes one
  self-contained DCP checkpoint per local rank into ``<step>.tmp/rank-<r>-of-<W>/`` and renames the
  directory once all ``W`` hold DCP's ``.metadata``, which the commit evidence checks again.
- NeMo (the library's ``ModelCheckpoint``, ``enable_high_scale_ckpt``, async save) saves global step
  ``G`` as an empty ``step=G-unfinished``, then ``step=G/`` (``<global rank>/__<rank>_*.distcp`` and
  ``.metadata`` per rank, ``common.pt``, ``metadata.json``); after its last barrier it deletes the
  ``-unfinished`` file, reads ``replicator.errors`` and renames ``step=G`` to ``<G-1>``: the commit,
  of step ``G-1``. So a real ``step=<n>/`` directory is the job's save (``StepScan.uncommitted``, or
  nothing while it is marked unfinished), never a restore it took: that is always our symlink to
  ``.mtc-staged-<n>``. NeMo removes its marked saves at start; a restore removes unmarked ones newer
  than its step (NeMo would load one); a new pod's publish removes both, with their marks.

Unlike Orbax's, a PyTorch job's ranks are fixed by its launcher (torchrun's ``--node-rank``): the
agent gives each pod the rank of its JobSet index (``ranks_follow_data`` False) and the job's
``node-rank`` must equal it. No ``jax-init-info.txt`` is written.
"""

import hashlib
import json
import re
from typing import Annotated, Literal

import msgspec

from replicator.local_tier import pod_files
from replicator.local_tier.frameworks.base import Files
from replicator.local_tier.frameworks.client_dir import (
    YAML_KEYS,
    ClientDirProtocol,
    IntervalSteps,
    PeerRanks,
    check_job_shape,
    checked_redundancy,
    load_config,
)
from replicator.wire.messages import Count, JobSettings, Rank

PRERESTORE_FILE = "replicator.prerestore"
# DCP's ``FileSystemWriter`` writes it once every data file of a checkpoint is written.
DCP_METADATA = ".metadata"
_ADOPTED = re.compile(r"^step=(?P<step>[0-9]{1,18})$", re.ASCII)
_LOCAL_RANK_DIR = re.compile(r"^rank-(?P<rank>[0-9]{1,6})-of-(?P<of>[0-9]{1,6})$", re.ASCII)
_RANK_HINT = (
    "; a PyTorch job must run with NODE_RANK equal to its pod's JobSet index (torchrun --node-rank, static rendezvous)"
)

_YAML_NAMES = {
    **YAML_KEYS,
    "peers_per_node": "peers-per-node",
    "workers_per_node": "workers-per-node",
}


class TorchReplicatorConfig(msgspec.Struct, frozen=True, rename=_YAML_NAMES):
    """A validated ``replicator.yaml`` of a ``pytorch.distributed`` job.

    Attributes:
      job_name, framework, node_rank, nodes: as the Resiliency library writes them.
      peers_per_node: ``peers-per-node``, the replicas the job asks for (the volume's ``replicas``
        attribute decides; accepted for compatibility).
      peer_ranks: ``peer-ranks``, the data-parallel peers; derived from ``assume-data-parallelism``
        when absent (the same index in every other group of ``nodes / data_parallelism`` ranks).
      data_parallelism: ``assume-data-parallelism`` (default 1).
      workers_per_node: ``workers-per-node``, the local ranks writing each step (default 1).
      backup_interval_minutes, backup_interval_steps: exactly one is set.
      redundancy: ``redundancy`` (``replicas``, ``xor:N`` or ``rs:N:K``), or None for the agents' ``--redundancy``.
    """

    job_name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    framework: Literal["pytorch.distributed"]
    node_rank: Rank
    nodes: Count
    peers_per_node: Annotated[int, msgspec.Meta(ge=0, le=64)] = 1
    peer_ranks: PeerRanks | None = None
    data_parallelism: Count = 1
    workers_per_node: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    backup_interval_minutes: Annotated[float, msgspec.Meta(gt=0)] | None = None
    backup_interval_steps: IntervalSteps | None = None
    redundancy: str | None = None


def data_parallel_peers(rank: int, nodes: int, data_parallelism: int) -> tuple[int, ...]:
    """The ranks holding the same data as ``rank`` when ``nodes`` form ``data_parallelism`` equal,
    consecutive groups (HSDP's replica groups, DDP when each group is one node): the same index in
    every other group."""
    per_group = nodes // data_parallelism
    return tuple(
        rank % per_group + group * per_group
        for group in range(data_parallelism)
        if rank % per_group + group * per_group != rank
    )


def parse_torch_config(text: str, expected_rank: int, expected_nodes: int) -> TorchReplicatorConfig:
    """Parses and validates a ``pytorch.distributed`` job's ``replicator.yaml``.

    Args:
      text: the file's contents.
      expected_rank: the rank the coordinator gave this pod (its JobSet index).
      expected_nodes: the job's node count from the volume attributes.

    Raises:
      InvalidReplicatorConfig: naming the field and the value.
    """
    config, raw = load_config(text, TorchReplicatorConfig)
    check_job_shape(
        raw,
        config.node_rank,
        config.nodes,
        config.data_parallelism,
        config.peer_ranks or (),
        expected_rank,
        expected_nodes,
        _RANK_HINT,
    )
    if config.peer_ranks is None:
        config = msgspec.structs.replace(
            config, peer_ranks=data_parallel_peers(config.node_rank, config.nodes, config.data_parallelism)
        )
    return config


class PyTorchDistributed(ClientDirProtocol):
    """``pytorch.distributed`` as a ``frameworks.Framework`` (the module docstring gives the files)."""

    name = "pytorch.distributed"
    ranks_follow_data = False
    handshake_files = (PRERESTORE_FILE, *ClientDirProtocol.handshake_files)
    # mtc_torch's ``<step>.tmp``; NeMo's ``step=<G>/`` (a symlink there is a restore: never removed) and its mark.
    unfinished_save = re.compile(r"^(?:[0-9]{1,18}\.tmp|step=[0-9]{1,18}(?:-unfinished)?)$", re.ASCII)
    unfinished_mark = "-unfinished"

    def adopted_name(self, step: int) -> str:
        """``step=<step>``: the Resiliency library renames our marker to it."""
        return f"step={step}"

    def _adopted_step(self, name: str) -> int | None:
        found = _ADOPTED.match(name)
        return int(found["step"]) if found else None

    # -- commit evidence ---------------------------------------------------------------------------

    def missing_commit_evidence(self, files: Files) -> str | None:
        """A step of ``mtc_torch`` holds ``rank-<r>-of-<W>/.metadata`` for every local rank ``r`` of
        ``W`` (all naming the same ``W``); any other layout (NeMo's own) at least one DCP ``.metadata``."""
        parts: dict[str, tuple[int, int]] = {}  # rank-<r>-of-<W> -> (r, W)
        complete: set[str] = set()
        for path in files:
            top, _, rest = path.partition("/")
            if found := _LOCAL_RANK_DIR.match(top):
                parts[top] = (int(found["rank"]), int(found["of"]))
                if rest == DCP_METADATA:
                    complete.add(top)
        if not parts:
            return None if any(path.rsplit("/", 1)[-1] == DCP_METADATA for path in files) else f"a DCP {DCP_METADATA}"
        counts = sorted({of for _, of in parts.values()})
        if len(counts) != 1:
            return f"one local-rank count (its parts name {counts})"
        done = {rank for part, (rank, _) in parts.items() if part in complete}
        missing = sorted(set(range(counts[0])) - done)
        return f"DCP's {DCP_METADATA} of local rank(s) {missing} of {counts[0]}" if missing else None

    def logical_signature(self, files: Files) -> str | None:
        """A SHA-256 hex digest of the checksums of the step's DCP ``.metadata`` files (the state
        dict's structure, shapes and file layout); None when it has none. ``mtc_torch`` writes them
        deterministically, so data-parallel replicas of a node write equal ones; a writer that puts a
        random id in them (plain DCP) never matches, and its peers' steps are replicated, not shared.
        """
        structural = sorted(
            (path, size, crc) for path, (size, crc) in files.items() if path.rsplit("/", 1)[-1] == DCP_METADATA
        )
        return hashlib.sha256(json.dumps(structural).encode()).hexdigest() if structural else None

    # -- the hand-shake ----------------------------------------------------------------------------

    def write_init_info(self, local_dir: str, rank: int, coordinator_address: str) -> None:
        """Nothing: torchrun gives the job its rank and rendezvous address."""

    def parse_config(self, text: str, expected_rank: int, expected_nodes: int) -> JobSettings:
        """The settings of ``replicator.yaml`` (see ``parse_torch_config``).

        Raises:
          InvalidReplicatorConfig: naming the field and the value.
        """
        config = parse_torch_config(text, expected_rank, expected_nodes)
        # parse_torch_config derives peer_ranks when absent: never None here.
        return JobSettings(
            config.peer_ranks or (),
            config.data_parallelism,
            config.backup_interval_minutes,
            config.backup_interval_steps,
            checked_redundancy(config.redundancy),
        )

    def _before_marker(self, dir_fd: int, step: int | None) -> None:
        """``replicator.prerestore`` (tmp + rename): ``restore-step: <step>``, or ``{}`` for a fresh start.
        Whatever the pod planted under the name (a directory the rename could not replace) goes first."""
        pod_files.remove(dir_fd, PRERESTORE_FILE)
        pod_files.write_atomic(dir_fd, PRERESTORE_FILE, b"{}\n" if step is None else f"restore-step: {step}\n".encode())
