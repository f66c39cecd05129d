"""``mtc status``: the coordinator's view of jobs as a readable table."""

import json
import urllib.error
import urllib.parse
import urllib.request

from replicator.wire import tls
from replicator.wire.bearer import auth_header
from replicator.wire.http_errors import error_of


def fetch_status(coordinator_url: str, job: str | None = None, ca_file: str | None = None, timeout: float = 10.0) -> dict:
    """GETs ``/v1/status`` from the coordinator (``ca_file``: CA bundle for an https:// URL).

    Raises:
      OSError: the coordinator is unreachable or answered an error.
    """
    query = "?" + urllib.parse.urlencode({"job": job}) if job else ""
    url = coordinator_url.rstrip("/") + "/v1/status" + query
    with urllib.request.urlopen(url, timeout=timeout, context=tls.client_context(ca_file)) as response:
        return json.load(response)


def request_restore_from(coordinator_url: str, namespace: str, job: str, step: int, token: str | None = None,
                         ca_file: str | None = None, timeout: float = 10.0) -> str:  # fmt: skip
    """Asks the coordinator to restore ``step`` at the job's next restart (``token``: the cluster token).

    Returns:
      An error message, or "" on success.

    Raises:
      OSError: the coordinator is unreachable.
    """
    url = f"{coordinator_url.rstrip('/')}/v1/jobs/{namespace}/{job}/restore-from"
    headers = {"Content-Type": "application/json", **(auth_header(token) if token else {})}
    request = urllib.request.Request(url, data=json.dumps({"step": step}).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=tls.client_context(ca_file)):
            return ""
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}: {error_of(err.read()) or err.reason}"


def render_status(status: dict) -> str:
    """Renders the status JSON as a table per job."""
    lines = [f"nodes: {', '.join(status['nodes']) or '(none)'}"]
    for job in status["jobs"]:
        restore = job["restore"]
        lines += [
            "",
            f"job {job['namespace']}/{job['job']}  incarnation {job['incarnation'] or '(waiting for pods: ' + str(job['waiting_pods']) + ')'}",
            f"  newest complete step: {job['newest_complete_step']}   safe for GC: {job['safe_step']}   "
            f"backups: {job['backups'] or '-'}{'  (backing up ' + str(job['backup_pending']) + ')' if job['backup_pending'] is not None else ''}",
            f"  restored step: {restore['step'] if restore else '-'}",
            f"  {'rank':>4}  {'node':<16} {'pod':<36} {'restored from':<22} steps held (step: nodes)",
        ]
        sources = restore["sources"] if restore else {}
        held = job["held"]
        for entry in job["ranks"]:
            rank = str(entry["rank"])
            steps = " ".join(f"{s}:{'+'.join(nodes)}" for s, nodes in sorted(held.get(rank, {}).items(), key=lambda i: int(i[0])))
            lines.append(f"  {rank:>4}  {entry['node']:<16} {entry['pod']:<36} {sources.get(rank, '-'):<22} {steps or '-'}")
    return "\n".join(lines)
