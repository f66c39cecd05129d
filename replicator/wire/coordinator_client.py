"""The node agent's HTTP client of the coordinator: reports, job settings, restore views and staging results.

The wire types are ``replicator.wire.messages``; the coordinator's side is ``replicator.coordinator.api.routes``.
"""

import uuid
from typing import Any, cast

import aiohttp
import msgspec

from replicator.pacing import timing
from replicator.wire.bearer import Tokens
from replicator.wire.http_errors import error_of
from replicator.wire.messages import (
    MAX_WAIT_SECONDS,
    NODE_TOKEN_HEADER,
    REPORT_ORDER_HEADER,
    BadCopy,
    JobSettings,
    NodeReport,
    PodRank,
    ReportReply,
    RestoreView,
    SettingsRequest,
    StagedReport,
    check_version,
    decode_json,
)


class CoordinatorUnavailable(Exception):
    """The coordinator could not be reached or refused the request."""


class CoordinatorClient:
    """The node agent's HTTP client of the coordinator. Bodies are encoded and replies decoded by
    msgspec, in one pass each (an agent's reports are its most frequent work).

    Args:
      session: the HTTP session to send with.
      base_url: the coordinator's base URL.
      tokens: the cluster's bearer tokens (the current one is sent), or None.
      node_token: the agent's projected ServiceAccount token, sent with each report as the proof of its
        node (``NODE_TOKEN_HEADER``), or None. Its file is read again when the kubelet rotates it.
    """

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, tokens: Tokens | None, node_token: Tokens | None = None
    ):
        self._session = session
        self._base = base_url.rstrip("/")
        self._tokens = tokens  # the current one is sent: a rotation takes effect on the next request
        self._node_token = node_token
        self._report_session, self._reports = uuid.uuid4().hex, 0  # the order of this process's reports

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        wait: float = 0.0,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """One request with ``body`` (a message) as JSON; its reply's
        body. A long poll (``wait`` seconds) gets that much more time.

        Raises:
          CoordinatorUnavailable: unreachable, timed out, or any status but 200 (the coordinator's
            JSON error in the message).
        """
        timeout = aiohttp.ClientTimeout(total=timing.REQUEST_TIMEOUT_SECONDS + wait)
        data = None if body is None else msgspec.json.encode(body)
        headers = {
            **(self._tokens.header() if self._tokens is not None else {}),
            # Every call proves the node: a restore view's peer grants go only to the rank's node.
            **({NODE_TOKEN_HEADER: self._node_token.current} if self._node_token is not None else {}),
            **({"Content-Type": "application/json"} if data is not None else {}),
            **(headers or {}),
        }
        try:
            async with self._session.request(
                method, self._base + path, headers=headers, data=data, params=params, timeout=timeout
            ) as response:
                raw = await response.read()
        except (TimeoutError, aiohttp.ClientError) as err:
            raise CoordinatorUnavailable(f"{method} {path}: {err!r}") from None
        if response.status != 200:
            raise CoordinatorUnavailable(f"{method} {path}: HTTP {response.status}: {error_of(raw)}")
        return raw

    async def report(self, report: NodeReport) -> ReportReply:
        """Sends a report; a ``waiting`` one may be held by the coordinator (long poll).

        Raises:
          CoordinatorUnavailable: unreachable, refused, or of another protocol version (named).
        """
        self._reports += 1
        headers = {REPORT_ORDER_HEADER: f"{self._report_session}:{self._reports}"}
        raw = await self._call(
            "POST", "/v1/report", report, wait=MAX_WAIT_SECONDS if report.waiting else 0.0, headers=headers
        )
        try:
            reply = decode_json(raw, ReportReply)
            check_version(reply.protocol, "the coordinator")
        except ValueError as err:
            raise CoordinatorUnavailable(f"POST /v1/report: {err}") from None
        return reply

    async def record_settings(self, pod: PodRank, settings: JobSettings) -> None:
        await self._call(
            "POST",
            f"/v1/jobs/{pod.job.namespace}/{pod.job.job}/settings",
            SettingsRequest(pod.incarnation, pod.rank, settings),
        )

    async def restore_view(self, pod: PodRank, seen: str | None = None, wait: float = MAX_WAIT_SECONDS) -> RestoreView:
        """The rank's restore view, a long poll of up to ``wait`` seconds (at most ``MAX_WAIT_SECONDS``): it returns once the
        coordinator can plan (else CoordinatorUnavailable, HTTP 503) and, with ``seen`` (a view's
        ``token``), once the view differs from it.

        Raises:
          CoordinatorUnavailable: as ``_call``, or a reply that is not a restore view.
        """
        wait = min(wait, MAX_WAIT_SECONDS)
        params = {"incarnation": pod.incarnation, "rank": str(pod.rank), "wait": str(wait)}
        if seen is not None:
            params["seen"] = seen
        path = f"/v1/jobs/{pod.job.namespace}/{pod.job.job}/restore"
        try:
            return decode_json(await self._call("GET", path, wait=wait, params=params), RestoreView)
        except ValueError as err:
            raise CoordinatorUnavailable(f"GET {path}: {err}") from None

    async def report_staged(
        self, pod: PodRank, generation: str, source: str | None, bad: list[BadCopy], retrying: bool = False
    ) -> None:
        """Reports the rank's staging result (``StagedReport``): the source it used, or None, and the
        copies proven unusable (step, rank, holder)."""
        report = StagedReport(
            pod.incarnation, generation, pod.rank, source, tuple(cast(BadCopy, tuple(b)) for b in bad), retrying
        )
        await self._call("POST", f"/v1/jobs/{pod.job.namespace}/{pod.job.job}/restore", report)
