"""What operators ask the coordinator: ``GET /v1/status`` (``mtc status``) and the rollback
``/v1/jobs/{ns}/{job}/restore-from`` (``mtc restore-from``: ``GET`` previews, ``POST`` requests,
``DELETE`` cancels). The node agents' messages are in ``replicator.wire.messages``.

Fields added after the first release have defaults, so a newer ``mtc`` reads an older coordinator's
replies."""

import msgspec

from replicator.wire.messages import Step


class RestoreFrom(msgspec.Struct, frozen=True, gc=False):
    """``POST /v1/jobs/{ns}/{job}/restore-from``: the step the job's next restore uses (a rollback)."""

    step: Step


class Done(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The reply of a route that only acknowledges (``{"ok": true}``); ``step`` echoes ``restore-from``'s."""

    ok: bool
    step: Step | None = None


class Health(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The coordinator's ``GET /healthz``: ``{"ok": true}``, and with ``--peer-grants`` ``grant_key``, the id
    (``replicator.wire.grants.key_id``) of the key it signs peer grants with, which ``mtc doctor`` looks for
    among an agent's."""

    ok: bool
    grant_key: str | None = None


class RankPlace(msgspec.Struct, frozen=True, gc=False):
    """A rank of a job's incarnation: its node and pod; ``silent``: the node has not reported
    within the node timeout (its rank's pod may be gone with it)."""

    rank: int
    node: str
    pod: str
    silent: bool = False


class ExcludedCopy(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """A copy a rank found unusable while restoring (corrupt, or gone from its holder), excluded from
    the incarnation's plans (``RestoreStatus.unusable_copies``). On the wire ``[step, rank, holder]``.
    Not the node side's ``step_manifest.UnusableCopy``, the error that proves a copy unusable."""

    step: int
    rank: int
    holder: str


class RestoreStatus(msgspec.Struct, frozen=True, gc=False):
    """The incarnation's restore: the planned step (None: start fresh), rank -> ``tier:holder`` it
    staged from, the copies proven unusable, and how many of its ``ranks`` have staged the step (the
    restore is in progress while fewer have)."""

    step: int | None
    sources: dict[int, str]
    unusable_copies: tuple[ExcludedCopy, ...]
    staged_ranks: int = 0
    ranks: int = 0


class JobStatus(msgspec.Struct, frozen=True, gc=False):
    """One job as ``GET /v1/status`` shows it.

    Attributes:
      incarnation: the current incarnation id, or None while ``waiting_pods`` wait for one.
      held: rank -> step -> the nodes holding a believed copy (``backup`` for the backup tier).
      identical_peers: pairs of ranks found to hold the same data at ``newest_complete_step``.
      forced_step: the step an operator asked the next restore to use, until a restore to it completes.
      timeline, rollbacks: how many rollbacks the job had, and their steps.
      silent_nodes: the job's nodes (of its incarnation, or of its pods) that have not reported
        within the node timeout -> seconds since they last did.
      pending_rollback: ``forced_step`` while its restore is not planned yet: it can still be
        cancelled, and nothing has been abandoned for it.
      last_backup_step: the newest complete backup of the job's lineage.
      last_backup_age_seconds: seconds since this coordinator first saw that backup complete. The
        backup tier's listings carry steps, not commit times: after a coordinator restart this is
        the time since its first listing, a lower bound of the backup's age. None if not seen yet.
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
    silent_nodes: dict[str, float] = msgspec.field(default_factory=dict)
    pending_rollback: int | None = None
    last_backup_step: int | None = None
    last_backup_age_seconds: float | None = None


class ClusterStatus(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """``GET /v1/status``: live and silent nodes, the jobs, and the heartbeat interval agents are told.

    Attributes:
      namespaces: with operator identity, when the caller may not read every namespace: the namespaces whose
        jobs it is shown, and ``nodes`` and ``silent_nodes`` are left empty. None (left out): every job and node.
    """

    nodes: tuple[str, ...]
    silent_nodes: tuple[str, ...]
    jobs: tuple[JobStatus, ...]
    heartbeat_seconds: float
    namespaces: tuple[str, ...] | None = None


class AbandonedStep(msgspec.Struct, frozen=True, gc=False):
    """A step newer than a rollback's, and where it is held: abandoned on every tier if the rollback
    is planned (never restored again; nodes delete their copies, retention the backup).

    Attributes:
      local: rank -> the nodes holding the rank's own data of the step (the local tier).
      peer: rank -> the nodes holding a replica of it (the peer tier).
      backup: the backup tier holds the step complete.
    """

    step: int
    local: dict[int, tuple[str, ...]]
    peer: dict[int, tuple[str, ...]]
    backup: bool


class RollbackPreview(msgspec.Struct, frozen=True, gc=False):
    """``GET /v1/jobs/{ns}/{job}/restore-from?step=N``: what ``POST`` of that step would do, changing nothing.

    Attributes:
      ranks: the job's rank count (every one of them holds ``step`` in some tier).
      abandoned: the steps newer than ``step`` held in any tier, ascending.
      timeline: the timeline the rollback begins when its restore is planned.
      pending_rollback: a rollback already requested and not planned, which the request would replace.
    """

    namespace: str
    job: str
    step: int
    ranks: int
    abandoned: tuple[AbandonedStep, ...]
    timeline: int
    pending_rollback: int | None
