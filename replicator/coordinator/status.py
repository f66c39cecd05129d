"""``mtc status`` and ``mtc restore-from``: the coordinator's client for operators. Replies are the
typed structs of ``replicator.wire.operator`` (``ClusterStatus``, ``Done``); errors are
``replicator.wire.http_errors`` bodies."""

import urllib.error
import urllib.parse
import urllib.request

import msgspec

from replicator.wire import tls
from replicator.wire.bearer import auth_header
from replicator.wire.http_errors import error_of
from replicator.wire.messages import JobRef, decode_json
from replicator.wire.operator import ClusterStatus, RestoreFrom


def fetch_status(coordinator_url: str, job: str | None = None, ca_file: str | None = None, timeout: float = 10.0) -> ClusterStatus:
    """GETs ``/v1/status`` from the coordinator (``ca_file``: CA bundle for an https:// URL).

    Raises:
      OSError: the coordinator is unreachable, answered an error, or a reply that is not a status.
    """
    query = "?" + urllib.parse.urlencode({"job": job}) if job else ""
    url = coordinator_url.rstrip("/") + "/v1/status" + query
    with urllib.request.urlopen(url, timeout=timeout, context=tls.client_context(ca_file)) as response:
        body = response.read()
    try:
        return decode_json(body, ClusterStatus)
    except ValueError as err:
        raise OSError(f"{url}: not a status: {err}") from None


def request_restore_from(coordinator_url: str, job: JobRef, step: int, token: str | None = None,
                         ca_file: str | None = None, timeout: float = 10.0) -> str:  # fmt: skip
    """Asks the coordinator to restore ``step`` at the job's next restart (``token``: the cluster token).

    Returns:
      An error message, or "" on success.

    Raises:
      OSError: the coordinator is unreachable.
    """
    url = f"{coordinator_url.rstrip('/')}/v1/jobs/{job.namespace}/{job.job}/restore-from"
    headers = {"Content-Type": "application/json", **(auth_header(token) if token else {})}
    request = urllib.request.Request(url, data=msgspec.json.encode(RestoreFrom(step)), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=tls.client_context(ca_file)):
            return ""
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}: {error_of(err.read()) or err.reason}"


def render_status(status: ClusterStatus) -> str:
    """Renders the status as a table per job."""
    lines = [f"nodes: {', '.join(status.nodes) or '(none)'}"]
    for job in status.jobs:
        restore = job.restore
        pending = f"  (backing up {job.backup_pending})" if job.backup_pending is not None else ""
        lines += [
            "",
            f"job {job.namespace}/{job.job}  incarnation {job.incarnation or f'(waiting for pods: {job.waiting_pods})'}",
            f"  newest complete step: {job.newest_complete_step}   safe for GC: {job.safe_step}   backups: {list(job.backups) or '-'}{pending}",
            f"  restored step: {restore.step if restore else '-'}",
            f"  {'rank':>4}  {'node':<16} {'pod':<36} {'restored from':<22} steps held (step: nodes)",
        ]
        sources = restore.sources if restore else {}
        for place in job.ranks:
            held = job.held.get(place.rank, {})
            steps = " ".join(f"{s}:{'+'.join(nodes)}" for s, nodes in sorted(held.items()))
            lines.append(f"  {place.rank:>4}  {place.node:<16} {place.pod:<36} {sources.get(place.rank, '-'):<22} {steps or '-'}")
    return "\n".join(lines)
