"""What the node agent needs from a training framework: the ``Framework`` protocol and its shared types.

The agent and the training job speak only through files in the job's client dir (the ramdisk's
``client/``, the pod's local checkpoint directory). A framework module (``orbax``, ``pytorch``) knows their names
and formats; the node code (``replicator.node``, ``prefetch``, the peer tier, ``local_tier``) asks
the job's ``Framework`` (``JobMeta.framework``) and never names a file of the protocol itself.

Every method that takes ``local_dir`` opens it through ``pod_files`` (the pod may have planted
symlinks, FIFOs or huge files there) and may raise ``FileNotFoundError`` when the dir is gone.
"""

import dataclasses
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from csi_driver import file_cache
from replicator.local_tier import pod_yaml
from replicator.wire.messages import JobSettings

# A step's checksums as its manifest holds them: path inside the step -> (size in bytes, CRC32C hex).
Files = Mapping[str, tuple[int, str]]


@dataclasses.dataclass(frozen=True)
class StepScan:
    """Steps in a client dir (see ``Framework.scan_steps``); each list ascending, without repeats.

    Attributes:
      committed: steps the job committed, including one it adopted through our restore marker.
      staged: steps a restore staged for a marker, under ``Framework.staged_name``.
      refused: steps whose name holds something that is not a directory (a planted symlink, a FIFO,
        a file): never read, never counted as committed.
      uncommitted: saves the job wrote under a step's name and has not committed: a real directory
        under the adopted marker's name (NeMo's ``step=<G>/`` before its rename to ``<G-1>``). Never
        ours (a restore stages under ``staged_name`` and its marker is a symlink), never an error,
        never counted; a restore removes those the job would load instead of its step.
    """

    committed: list[int]
    staged: list[int]
    refused: list[int]
    uncommitted: list[int] = dataclasses.field(default_factory=list)

    @property
    def held(self) -> list[int]:
        """Committed plus staged steps: everything the dir holds, ascending."""
        return sorted(set(self.committed) | set(self.staged))


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """The job's config file, read once.

    Attributes:
      data: its bytes (decode them as UTF-8).
      version: ``file_cache.key_of`` of the descriptor they were read from: any write, truncation or
        replacement of the file changes it, so equal versions mean the file stayed as read.
    """

    data: bytes
    version: file_cache.Key


class InvalidReplicatorConfig(ValueError):
    """The job's ``replicator.yaml`` is unusable; ``field`` names the offending key (``(document)``
    when the file as a whole is). The message is cut to 512 characters (``pod_yaml.bounded``).

    Attributes:
      field: the offending key.
      final: the text read so far is refused whatever follows it (an anchor, an alias, deep nesting),
        so a file still being written is refused at once, not after it settles.
    """

    def __init__(self, field: str, message: str, final: bool = False):
        super().__init__(f"replicator.yaml field {field}: {pod_yaml.bounded(message)}")
        self.field = field
        self.final = final


@runtime_checkable
class Framework(Protocol):
    """A training framework's side of the client dir, as the node agent uses it.

    An implementation is stateless towards the caller (one shared instance per framework, in
    ``frameworks.REGISTRY``) and thread-safe: the agent calls it from its event loop and from worker
    threads at once.

    Attributes:
      name: the framework's name, as the job writes it in ``replicator.yaml`` (``framework:``) and
        the pod asks for it in the volume attribute ``framework``: the registry key.
      ranks_follow_data: True when the job takes the rank the node gives it (Orbax reads it from
        ``jax-init-info.txt``), so a pod may get the rank whose data its node holds; False when the
        job's launcher fixes it (torchrun): each pod then gets the rank of its JobSet index.
    """

    name: str
    ranks_follow_data: bool

    # -- the client dir's layout -----------------------------------------------------------------

    def scan_steps(self, local_dir: str) -> StepScan:
        """The steps ``local_dir`` holds, listed without following any link the pod may have planted.

        A committed step is the framework's commit (for Orbax ``<step>/``, renamed from
        ``<step>.orbax-checkpoint-tmp/``), or a restore marker the job took (the job renamed our
        marker, a symlink to ``staged_name(step)``, to the step's name): this is how the node sees
        that the job took the marker. Names still being written (temporary names) never count, nor
        do the job's own saves under the adopted name (``StepScan.uncommitted``).
        """
        ...

    def cached_scan(self, local_dir: str) -> StepScan | None:
        """``scan_steps(local_dir)`` when that costs no listing (the dir is unchanged since the last
        scan), else None; cheap enough for an event loop. An implementation may always return None."""
        ...

    def find_step_dir(self, local_dir: str, step: int) -> str | None:
        """The path of the real directory holding ``step`` (staged or committed), never a symlink;
        None when the dir holds no such directory."""
        ...

    def staged_name(self, step: int) -> str:
        """The name, in the client dir, under which a restore places a verified step before the
        marker points at it. The job must ignore it as a step (for Orbax ``.mtc-staged-<step>``)."""
        ...

    def resharded_name(self, step: int) -> str:
        """The name under which an elastic restore stages other nodes' copies of ``step``
        (``prefetch.resharded``); never taken for a step of this node."""
        ...

    def step_names(self, step: int) -> tuple[str, ...]:
        """Every name ``step`` can have in the client dir (committed, staged, adopted marker): what
        deleting the step removes."""
        ...

    def steps_restored_instead(self, scan: StepScan, step: int | None) -> list[int]:
        """The steps of ``scan`` the job would restore instead of ``step`` (every step when None),
        which a restore must take out of the client dir before it writes the marker."""
        ...

    # -- commit evidence ---------------------------------------------------------------------------

    def missing_commit_evidence(self, files: Files) -> str | None:
        """What a step's checksums lack to be a complete checkpoint, phrased to follow "lacks"
        (e.g. ``"Orbax's _CHECKPOINT_METADATA"``); None when the step is complete."""
        ...

    def logical_signature(self, files: Files) -> str | None:
        """A hex digest of the step's structure (not its array bytes): equal on data-parallel
        replicas of one step, which the coordinator compares before treating one replica's step as
        another's; None when the step carries no structure to compare."""
        ...

    # -- the hand-shake ----------------------------------------------------------------------------

    def write_init_info(self, local_dir: str, rank: int, coordinator_address: str) -> None:
        """Tells the job its rank and where rank 0's coordinator listens (``host:port``), written
        whole (tmp + rename). A framework whose job learns its rank elsewhere writes nothing."""
        ...

    def read_config(self, local_dir: str) -> ConfigFile | None:
        """The job's config file (``replicator.yaml``) as read now, or None while it has not written one.

        Raises:
          pod_files.UnsafeEntry: it is not a regular file, or is too large.
        """
        ...

    def parse_config(self, text: str, expected_rank: int, expected_nodes: int) -> JobSettings:
        """Validates the config file's ``text`` against the rank this node assigned and the volume's
        node count, and returns the settings the coordinator records.

        Raises:
          InvalidReplicatorConfig: naming the field and the value.
        """
        ...

    def consume_config(self, local_dir: str) -> None:
        """Deletes the config file: the job waits for that (or for ``replicator.failed``) to go on."""
        ...

    def clear_previous_pod(self, local_dir: str) -> None:
        """Removes what a previous pod's hand-shake left (rank file, config, reports, markers,
        temporary files), so a new pod never reads its predecessor's rank."""
        ...

    # -- restore markers ---------------------------------------------------------------------------

    def write_restore_marker(self, local_dir: str, job: str, step: int, rank: int, resharded: bool = False) -> str:
        """Tells the job to restore ``step``, staged under ``staged_name(step)`` (``resharded``:
        ``resharded_name(step)``); returns the marker's path.

        Raises:
          FileNotFoundError: the step is not staged.
        """
        ...

    def write_fresh_start_marker(self, local_dir: str, job: str, rank: int) -> str:
        """Tells the job no checkpoint exists: start from scratch. Returns the marker's path."""
        ...

    def remove_markers(self, local_dir: str) -> None:
        """Removes restore markers the job has not taken (a previous incarnation's)."""
        ...

    # -- the error files ---------------------------------------------------------------------------

    def report_error(self, local_dir: str, log_dir: str, message: str) -> None:
        """Appends a recoverable error for the job to log (``replicator.errors``).

        Args:
          local_dir: the client dir.
          log_dir: an agent-owned directory of the same job, where the report's content is kept
            (the pod's copy is never read back).
        """
        ...

    def report_failure(self, local_dir: str, log_dir: str, message: str) -> None:
        """Writes a fatal error (``replicator.failed``): the job stops with ``message``."""
        ...
