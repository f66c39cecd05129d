"""What operators ask the coordinator: ``GET /v1/status`` (``mtc status``) and the rollback
``POST /v1/jobs/{ns}/{job}/restore-from`` (``mtc restore-from``). The node agents' messages are in
``replicator.wire.messages``."""

import msgspec

from replicator.wire.messages import Step


class RestoreFrom(msgspec.Struct, frozen=True, gc=False):
    """``POST /v1/jobs/{ns}/{job}/restore-from``: the step the job's next restore uses (a rollback)."""

    step: Step


class Done(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The reply of a route that only acknowledges (``{"ok": true}``); ``step`` echoes ``restore-from``'s."""

    ok: bool
    step: Step | None = None


class RankPlace(msgspec.Struct, frozen=True, gc=False):
    """A rank of a job's incarnation: its node and pod."""

    rank: int
    node: str
    pod: str


class RestoreStatus(msgspec.Struct, frozen=True, gc=False):
    """The incarnation's restore: the planned step, rank -> ``tier:holder`` it staged from, and the
    copies proven unusable."""

    step: int | None
    sources: dict[int, str]
    unusable_copies: tuple[tuple[int, int, str], ...]


class JobStatus(msgspec.Struct, frozen=True, gc=False):
    """One job as ``GET /v1/status`` shows it.

    Attributes:
      incarnation: the current incarnation id, or None while ``waiting_pods`` wait for one.
      held: rank -> step -> the nodes holding a believed copy (``backup`` for the backup tier).
      identical_peers: pairs of ranks found to hold the same data at ``newest_complete_step``.
      timeline, rollbacks: how many rollbacks the job had, and their steps.
    """

    namespace: str
    job: str
    incarnation: str | None
    waiting_pods: int
    ranks: tuple[RankPlace, ...]
    newest_complete_step: int | None
    restore: RestoreStatus | None
    held: dict[int, dict[int, tuple[str, ...]]]
    identical_peers: tuple[tuple[int, int], ...]
    safe_step: int | None
    backups: tuple[int, ...]
    backup_pending: int | None
    backup_lister: str | None
    forced_step: int | None
    timeline: int
    rollbacks: tuple[int, ...]


class ClusterStatus(msgspec.Struct, frozen=True, gc=False):
    """``GET /v1/status``: live and silent nodes, the jobs, and the heartbeat interval agents are told."""

    nodes: tuple[str, ...]
    silent_nodes: tuple[str, ...]
    jobs: tuple[JobStatus, ...]
    heartbeat_seconds: float
