"""JSON messages between node agents and the coordinator, parsed into typed values at the edge.

Every ``from_json`` raises ``ValueError`` naming the bad field, so a handler answers 400.
"""

import dataclasses
from typing import Any


def _field(raw: dict, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    value = raw.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {key!r}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _require_dict(raw: Any, what: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: expected a JSON object")
    return raw


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """A job's settings from its consumed ``replicator.yaml`` (see ``orbax_protocol``)."""

    peer_ranks: tuple[int, ...]
    data_parallelism: int
    backup_interval_minutes: float | None
    backup_interval_steps: int | None

    @classmethod
    def from_json(cls, raw: Any) -> "JobSettings":
        raw = _require_dict(raw, "settings")
        peers = _field(raw, "peer_ranks", list)
        if not all(isinstance(p, int) for p in peers):
            raise ValueError(f"field 'peer_ranks': expected ranks, got {peers!r}")
        return cls(
            tuple(peers),
            _field(raw, "data_parallelism", int),
            _field(raw, "backup_interval_minutes", (int, float), optional=True),
            _field(raw, "backup_interval_steps", int, optional=True),
        )


@dataclasses.dataclass(frozen=True)
class PodReport:
    """A pod published on the reporting node, with what the node knows of its rank.

    Attributes:
      namespace, job, pod_name, pod_uid: identity.
      slice_index, worker_index: from the JobSet pod name or attributes, or None.
      nodes, slices: the job's shape from the volume attributes.
      jax_coordinator_port: the port rank 0's JAX coordinator listens on.
      subdomain: the JobSet DNS subdomain (pods are ``<pod name without suffix>.<subdomain>``).
      published_at: unix seconds of its NodePublishVolume.
      incarnation, rank: the assignment the node holds for it, or None.
      settings: its consumed ``replicator.yaml``, or None.
    """

    namespace: str
    job: str
    pod_name: str
    pod_uid: str
    slice_index: int | None
    worker_index: int | None
    nodes: int
    slices: int
    jax_coordinator_port: int
    subdomain: str
    published_at: float
    incarnation: str | None = None
    rank: int | None = None
    settings: JobSettings | None = None

    @classmethod
    def from_json(cls, raw: Any) -> "PodReport":
        raw = _require_dict(raw, "pod")
        settings = raw.get("settings")
        return cls(
            namespace=_field(raw, "namespace", str),
            job=_field(raw, "job", str),
            pod_name=_field(raw, "pod_name", str),
            pod_uid=_field(raw, "pod_uid", str),
            slice_index=_field(raw, "slice_index", int, optional=True),
            worker_index=_field(raw, "worker_index", int, optional=True),
            nodes=_field(raw, "nodes", int),
            slices=_field(raw, "slices", int),
            jax_coordinator_port=_field(raw, "jax_coordinator_port", int),
            subdomain=_field(raw, "subdomain", str),
            published_at=float(_field(raw, "published_at", (int, float))),
            incarnation=_field(raw, "incarnation", str, optional=True),
            rank=_field(raw, "rank", int, optional=True),
            settings=None if settings is None else JobSettings.from_json(settings),
        )


@dataclasses.dataclass(frozen=True)
class HeldStep:
    """A committed, checksummed step of one rank's data on the reporting node.

    Attributes:
      files: relative path -> (size bytes, CRC32C hex), from the step's manifest.
      replica: True for a copy a peer pushed here, False for the node's own data.
    """

    namespace: str
    job: str
    step: int
    rank: int
    files: dict[str, tuple[int, str]]
    replica: bool = False

    @classmethod
    def from_json(cls, raw: Any) -> "HeldStep":
        raw = _require_dict(raw, "held step")
        files = _require_dict(raw.get("files"), "files")
        return cls(
            _field(raw, "namespace", str),
            _field(raw, "job", str),
            _field(raw, "step", int),
            _field(raw, "rank", int),
            {str(k): (int(v[0]), str(v[1])) for k, v in files.items()},
            bool(raw.get("replica", False)),
        )


@dataclasses.dataclass(frozen=True)
class BackedUp:
    """The steps of a job the backup tier holds complete (``COMMIT`` written), as the node last listed them."""

    namespace: str
    job: str
    steps: tuple[int, ...]

    @classmethod
    def from_json(cls, raw: Any) -> "BackedUp":
        raw = _require_dict(raw, "backed up")
        return cls(_field(raw, "namespace", str), _field(raw, "job", str), tuple(int(s) for s in _field(raw, "steps", list)))


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """Everything a node agent tells the coordinator; sent on every change and as its heartbeat.

    Attributes:
      node_id: the node's name.
      url: the agent's HTTP base URL (peer service).
      pod_address: the address pods on the node are reachable at, or None for JobSet DNS.
      topology: topology labels (``--topology``).
      pods: the pods published on the node.
      held: the committed steps the node holds, its own and replicas of other ranks'.
      replicas: how many peers should hold replicas of this node's steps (``--replicas``).
      backed_up: per job, the complete backups the node saw in the backup tier, once listed.
      has_backup: whether the node has a backup tier (``--backup``).
    """

    node_id: str
    url: str
    pod_address: str | None
    topology: dict[str, str]
    pods: tuple[PodReport, ...]
    held: tuple[HeldStep, ...]
    replicas: int = 1
    backed_up: tuple[BackedUp, ...] = ()
    has_backup: bool = False

    @classmethod
    def from_json(cls, raw: Any) -> "NodeReport":
        raw = _require_dict(raw, "report")
        return cls(
            node_id=_field(raw, "node_id", str),
            url=_field(raw, "url", str),
            pod_address=_field(raw, "pod_address", str, optional=True),
            topology={str(k): str(v) for k, v in _require_dict(raw.get("topology", {}), "topology").items()},
            pods=tuple(PodReport.from_json(p) for p in _field(raw, "pods", list)),
            held=tuple(HeldStep.from_json(h) for h in _field(raw, "held", list)),
            replicas=_field(raw, "replicas", int, optional=True) or 1,
            backed_up=tuple(BackedUp.from_json(b) for b in raw.get("backed_up", [])),
            has_backup=bool(raw.get("has_backup", False)),
        )


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A pod's place in its job's incarnation.

    Attributes:
      incarnation: id of the set of pods this assignment belongs to.
      rank: the pod's node rank (JAX process id).
      jax_coordinator: ``host:port`` of rank 0's JAX coordinator.
    """

    pod_uid: str
    incarnation: str
    rank: int
    jax_coordinator: str

    @classmethod
    def from_json(cls, raw: Any) -> "Assignment":
        raw = _require_dict(raw, "assignment")
        return cls(_field(raw, "pod_uid", str), _field(raw, "incarnation", str), _field(raw, "rank", int), _field(raw, "jax_coordinator", str))


@dataclasses.dataclass(frozen=True)
class ReplicateOrder:
    """Push ``rank``'s ``step`` from the receiving node to ``targets`` (``{"node", "url"}`` each)."""

    namespace: str
    job: str
    rank: int
    step: int
    targets: tuple[dict, ...]

    @classmethod
    def from_json(cls, raw: Any) -> "ReplicateOrder":
        raw = _require_dict(raw, "replicate")
        targets = tuple(_require_dict(t, "target") for t in _field(raw, "targets", list))
        return cls(_field(raw, "namespace", str), _field(raw, "job", str), _field(raw, "rank", int), _field(raw, "step", int), targets)


@dataclasses.dataclass(frozen=True)
class RetainOrder:
    """Garbage collection: delete the job's steps and replicas older than ``keep_from``, except ``protected``."""

    namespace: str
    job: str
    keep_from: int
    protected: tuple[int, ...]

    @classmethod
    def from_json(cls, raw: Any) -> "RetainOrder":
        raw = _require_dict(raw, "retain")
        protected = _field(raw, "protected", list)
        return cls(_field(raw, "namespace", str), _field(raw, "job", str), _field(raw, "keep_from", int), tuple(int(p) for p in protected))


@dataclasses.dataclass(frozen=True)
class BackupOrder:
    """Upload ``rank``'s own data of ``step`` to the backup tier.

    Attributes:
      incarnation: tags the upload; ``COMMIT`` joins only ranks of one incarnation.
      nodes: the job's rank count, for ``COMMIT``.
      dedup_from_rank: a data-parallel peer whose upload of the step to reference for identical
        files (wait for it), or None to upload everything.
      protected: backup steps retention must keep (a restore is using them).
    """

    namespace: str
    job: str
    step: int
    rank: int
    incarnation: str
    nodes: int
    dedup_from_rank: int | None
    protected: tuple[int, ...]

    @classmethod
    def from_json(cls, raw: Any) -> "BackupOrder":
        raw = _require_dict(raw, "backup")
        return cls(
            _field(raw, "namespace", str), _field(raw, "job", str), _field(raw, "step", int), _field(raw, "rank", int),
            _field(raw, "incarnation", str), _field(raw, "nodes", int), _field(raw, "dedup_from_rank", int, optional=True),
            tuple(int(p) for p in _field(raw, "protected", list)),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ReportReply:
    """The coordinator's answer to a ``NodeReport``: what the node's pods and data should do."""

    assignments: tuple[Assignment, ...]
    replicate: tuple[ReplicateOrder, ...]
    retain: tuple[RetainOrder, ...]
    backup: tuple[BackupOrder, ...] = ()

    @classmethod
    def from_json(cls, raw: Any) -> "ReportReply":
        raw = _require_dict(raw, "reply")
        return cls(
            tuple(Assignment.from_json(a) for a in _field(raw, "assignments", list)),
            tuple(ReplicateOrder.from_json(r) for r in raw.get("replicate", [])),
            tuple(RetainOrder.from_json(r) for r in raw.get("retain", [])),
            tuple(BackupOrder.from_json(b) for b in raw.get("backup", [])),
        )


@dataclasses.dataclass(frozen=True)
class RestoreView:
    """What one rank must restore, as the coordinator sees it now.

    Attributes:
      generation: id of the current plan; a new one after a source failed everywhere.
      step: the step every rank restores, or None to start fresh.
      sources: preference-ordered ``{"tier", "holder", "url", "data_rank"}`` for this rank.
      ready: True once every rank has staged and verified the step: write the marker.
    """

    generation: str
    step: int | None
    sources: tuple[dict, ...]
    ready: bool

    @classmethod
    def from_json(cls, raw: Any) -> "RestoreView":
        raw = _require_dict(raw, "restore")
        return cls(
            _field(raw, "generation", str),
            _field(raw, "step", int, optional=True),
            tuple(_require_dict(s, "source") for s in _field(raw, "sources", list)),
            _field(raw, "ready", bool),
        )


def to_json(message: Any) -> Any:
    """A message (or list of them) as plain JSON-ready values."""
    return dataclasses.asdict(message) if dataclasses.is_dataclass(message) else [to_json(m) for m in message]
