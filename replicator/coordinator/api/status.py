"""``mtc status`` and ``mtc restore-from``: the coordinator's client for operators, and how its
answers print. Replies are the typed structs of ``replicator.wire.operator`` (``ClusterStatus``,
``RollbackPreview``, ``Done``); errors are ``replicator.wire.http_errors`` bodies."""

import dataclasses
import urllib.error
import urllib.parse
import urllib.request
from typing import TypeVar

import msgspec

from replicator.wire import tls
from replicator.wire.bearer import auth_header
from replicator.wire.http_errors import error_of
from replicator.wire.messages import JobRef, decode_json
from replicator.wire.operator import (
    ClusterStatus,
    Done,
    JobStatus,
    RestoreFrom,
    RollbackPreview,
)

M = TypeVar("M")


class Refused(OSError):
    """The coordinator answered with an HTTP error; ``str()`` is ``HTTP <code>: <its error>``.

    Attributes:
      code: the HTTP status (404: unknown job, 409: a refused rollback or cancel).
    """

    def __init__(self, code: int, message: str):
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


@dataclasses.dataclass(frozen=True)
class Coordinator:
    """The coordinator as an operator reaches it.

    Attributes:
      url: its base URL, e.g. ``https://127.0.0.1:8471``.
      ca_file: the CA bundle (PEM) its certificate is checked against, else the system's CAs.
      server_name: the name its certificate is checked against instead of the URL's host (through
        ``kubectl port-forward``).
      token: the bearer token sent with every request: the operator's own Kubernetes token (a coordinator with
        operator identity checks it with RBAC), or the cluster token (one without it requires that for a rollback).
      timeout: seconds per request.
    """

    url: str
    ca_file: str | None = None
    server_name: str | None = None
    token: str | None = None
    timeout: float = 10.0

    def status(self, job: JobRef | str | None = None) -> ClusterStatus:
        """``GET /v1/status``, of one job (``NAMESPACE/JOB``, or every job of a bare name) or all.

        Raises:
          Refused: 404, no such job; 401, 403 (operator identity: no token, or not allowed to read the named job).
          OSError: unreachable, or a reply that is not a status.
        """
        return self._call(
            "GET", "/v1/status" + ("?" + urllib.parse.urlencode({"job": str(job)}) if job else ""), ClusterStatus
        )

    def preview_restore_from(self, job: JobRef, step: int) -> RollbackPreview:
        """What rolling ``job`` back to ``step`` would abandon; changes nothing.

        Raises:
          Refused: 401, 403 (operator identity); 404, no such job; 409, no tier holds the step complete.
          OSError: unreachable.
        """
        return self._call("GET", f"{_rollback_path(job)}?step={step}", RollbackPreview)

    def restore_from(self, job: JobRef, step: int) -> None:
        """Makes the job's next restore use ``step`` (a rollback, cancellable until it is planned).

        Raises:
          Refused: 401, 403 (not allowed), 404, or 409 (no tier holds the step complete). OSError: unreachable.
        """
        self._call("POST", _rollback_path(job), Done, RestoreFrom(step))

    def cancel_restore_from(self, job: JobRef) -> int | None:
        """Cancels the job's pending rollback; returns its step.

        Raises:
          Refused: 401, 403 (not allowed), 404, or 409 (none pending, or its restore is planned). OSError: unreachable.
        """
        return self._call("DELETE", _rollback_path(job), Done).step

    def _call(self, method: str, path: str, kind: type[M], body: object = None) -> M:
        url = self.url.rstrip("/") + path
        headers = {"Content-Type": "application/json", **(auth_header(self.token) if self.token else {})}
        data = msgspec.json.encode(body) if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with tls.opener(self.ca_file, self.server_name).open(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise Refused(err.code, error_of(err.read()) or str(err.reason)) from None
        try:
            return decode_json(raw, kind)
        except ValueError as err:
            raise OSError(f"{url}: not a {kind.__name__}: {err}") from None


def _rollback_path(job: JobRef) -> str:
    return f"/v1/jobs/{job.namespace}/{job.job}/restore-from"


def fetch_status(
    coordinator_url: str, job: str | None = None, ca_file: str | None = None, timeout: float = 10.0
) -> ClusterStatus:
    """``Coordinator(coordinator_url, ca_file).status(job)``.

    Raises:
      OSError: the coordinator is unreachable, answered an error, or a reply that is not a status.
    """
    return Coordinator(coordinator_url, ca_file, timeout=timeout).status(job)


def render_status(status: ClusterStatus) -> str:
    """Renders the status: the nodes (or, for a reader of some namespaces only, which it shows), then per job a summary of what needs attention (silent nodes,
    a pending rollback, the restore's progress and unusable copies, the last backup) before a row per
    rank, a silent node's rank marked ``!``."""
    if status.namespaces is not None:  # operator identity, without a cluster-wide grant
        shown = ", ".join(status.namespaces) or "none"
        lines = [f"nodes: not shown (you may read some namespaces' jobs only; shown: {shown})"]
    else:
        silent = f", {len(status.silent_nodes)} silent: {', '.join(status.silent_nodes)}" if status.silent_nodes else ""
        lines = [f"nodes: {len(status.nodes)} live{silent}"]
    for job in status.jobs:
        lines += ["", *_job_summary(job)]
        restore = job.restore
        sources = restore.sources if restore else {}
        lines.append(f"    {'rank':>5}  {'node':<16} {'pod':<36} {'restored from':<22} steps held (step: nodes)")
        for place in job.ranks:
            held = job.held.get(place.rank, {})
            steps = " ".join(f"{s}:{'+'.join(nodes)}" for s, nodes in sorted(held.items()))
            node = f"{place.node} SILENT" if place.silent else place.node
            lines.append(
                f"  {'!' if place.silent else ' '} {place.rank:>5}  {node:<16} {place.pod:<36} {sources.get(place.rank, '-'):<22} {steps or '-'}"
            )
    return "\n".join(lines)


def _job_summary(job: JobStatus) -> list[str]:
    on_silent = sum(p.silent for p in job.ranks)
    ranks = f"  ranks {len(job.ranks)}" + (f" ({on_silent} on silent nodes)" if on_silent else "") if job.ranks else ""
    lines = [
        f"job {job.namespace}/{job.job}  incarnation {job.incarnation or f'(waiting for pods: {job.waiting_pods})'}{ranks}",
        f"  newest complete step: {job.newest_complete_step}   safe for GC: {job.safe_step}   timeline: {job.timeline}",
    ]
    pending = f"  (backing up {job.backup_pending})" if job.backup_pending is not None else ""
    if job.last_backup_step is None:
        lines.append(f"  last backup: none{pending}")
    else:
        age = f", {job.last_backup_age_seconds:.0f} s ago" if job.last_backup_age_seconds is not None else ""
        lines.append(f"  last backup: step {job.last_backup_step}{age}   backups: {list(job.backups)}{pending}")
    restore = job.restore
    if restore is None:
        lines.append("  restore: not planned")
    elif restore.step is None:
        lines.append("  restore: fresh start (no step held)")
    else:
        progress = "in progress" if restore.staged_ranks < restore.ranks else "done"
        lines.append(
            f"  restore: step {restore.step}, {restore.staged_ranks}/{restore.ranks} ranks staged ({progress})"
        )
    if restore is not None and restore.unusable_copies:
        copies = "; ".join(f"rank {c.rank} step {c.step} on {c.holder}" for c in restore.unusable_copies)
        lines.append(f"  unusable copies ({len(restore.unusable_copies)}): {copies}")
    if job.pending_rollback is not None:
        lines.append(
            f"  PENDING ROLLBACK to step {job.pending_rollback}: not planned yet "
            f"(mtc restore-from --job {job.namespace}/{job.job} --cancel withdraws it)"
        )
    if job.silent_nodes:
        lines.append(
            f"  SILENT NODES ({len(job.silent_nodes)}): "
            + ", ".join(f"{n} ({s:.0f} s)" for n, s in job.silent_nodes.items())
        )
    return lines


def render_preview(preview: RollbackPreview) -> str:
    """Renders what a rollback abandons: per newer step, its ranks' holders on each tier."""
    lines = [
        f"{preview.namespace}/{preview.job}: the next restore uses step {preview.step} ({preview.ranks} ranks); "
        f"timeline {preview.timeline} begins when that restore is planned."
    ]
    if preview.pending_rollback == preview.step:
        lines.append(f"A rollback to step {preview.step} is already pending.")
    elif preview.pending_rollback is not None:
        lines.append(f"It replaces the pending rollback to step {preview.pending_rollback}.")
    if not preview.abandoned:
        lines.append(f"Nothing newer than step {preview.step} is held: nothing is abandoned.")
        return "\n".join(lines)
    lines.append(
        f"Abandoned on every tier (never restored again; nodes delete their copies, retention the backups): "
        f"{len(preview.abandoned)} steps"
    )
    for step in preview.abandoned:
        tiers = [
            _tier("local", step.local, preview.ranks),
            _tier("peer", step.peer, preview.ranks),
            f"backup {'yes' if step.backup else '-'}",
        ]
        lines.append(f"  step {step.step}: " + "; ".join(tiers))
    return "\n".join(lines)


def _tier(name: str, holders: dict[int, tuple[str, ...]], ranks: int) -> str:
    if not holders:
        return f"{name} -"
    nodes = {n for held in holders.values() for n in held}
    return f"{name} {len(holders)}/{ranks} ranks on {len(nodes)} nodes"
