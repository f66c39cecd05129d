"""The node agent's HTTP client of the coordinator: reports, job settings, restore views and staging results.

The wire types are ``replicator.messages``; the coordinator's side is ``replicator.coordinator.service``.
"""

import asyncio

import aiohttp

from csi_driver.ramdisk import Ramdisk
from replicator import timing
from replicator.bearer import auth_header
from replicator.job_meta import PodProgress
from replicator.messages import MAX_WAIT_SECONDS, JobSettings, NodeReport, ReportReply, RestoreView, check_version, decode, to_json


class CoordinatorUnavailable(Exception):
    """The coordinator could not be reached or refused the request."""


class CoordinatorClient:
    """The node agent's HTTP client of the coordinator."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None):
        self._session = session
        self._base = base_url.rstrip("/")
        self._headers = auth_header(token) if token else {}

    async def _call(self, method: str, path: str, wait: float = 0.0, **kwargs) -> dict:
        """One request; a long poll (``wait`` seconds) gets that much more time."""
        timeout = aiohttp.ClientTimeout(total=timing.REQUEST_TIMEOUT_SECONDS + wait)
        try:
            async with self._session.request(method, self._base + path, headers=self._headers, timeout=timeout, **kwargs) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise CoordinatorUnavailable(f"{method} {path}: HTTP {response.status}: {body.get('error', body)}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            raise CoordinatorUnavailable(f"{method} {path}: {err!r}") from None

    async def report(self, report: NodeReport) -> ReportReply:
        """Sends a report; a ``waiting`` one may be held by the coordinator (long poll).

        Raises:
          CoordinatorUnavailable: unreachable, refused, or of another protocol version (named).
        """
        body = await self._call("POST", "/v1/report", wait=MAX_WAIT_SECONDS if report.waiting else 0.0, json=to_json(report))
        try:
            reply = decode(body, ReportReply)
            check_version(reply.protocol, "the coordinator")
        except ValueError as err:
            raise CoordinatorUnavailable(f"POST /v1/report: {err}") from None
        return reply

    async def record_settings(self, disk: Ramdisk, progress: PodProgress, settings: JobSettings) -> None:
        payload = {"incarnation": progress.incarnation, "rank": progress.rank, "settings": to_json(settings)}
        await self._call("POST", f"/v1/jobs/{disk.namespace}/{disk.job}/settings", json=payload)

    async def restore_view(self, disk: Ramdisk, progress: PodProgress, seen: str | None = None) -> RestoreView:
        """The rank's restore view, a long poll of up to ``MAX_WAIT_SECONDS``: it returns once the
        coordinator can plan (else CoordinatorUnavailable, HTTP 503) and, with ``seen`` (a view's
        ``token``), once the view differs from it."""
        params = {"incarnation": progress.incarnation, "rank": str(progress.rank), "wait": str(MAX_WAIT_SECONDS)}
        if seen is not None:
            params["seen"] = seen
        return decode(await self._call("GET", f"/v1/jobs/{disk.namespace}/{disk.job}/restore", wait=MAX_WAIT_SECONDS, params=params),
                      RestoreView)  # fmt: skip

    async def report_staged(self, disk: Ramdisk, progress: PodProgress, generation: str, source: str | None, bad: list,
                            retrying: bool = False) -> None:  # fmt: skip
        payload = {"incarnation": progress.incarnation, "generation": generation, "rank": progress.rank, "source": source,
                   "bad": bad, "retrying": retrying}  # fmt: skip
        await self._call("POST", f"/v1/jobs/{disk.namespace}/{disk.job}/restore", json=payload)
