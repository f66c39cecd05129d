"""The node agent's side of change-driven reporting (protocol version 2).

A ``ReportSession`` turns what the node holds into ``NodeReport`` messages and decides when one is
worth sending:

- at once when what the report says changed (a pod, a step, a backup listing) or when poked;
- otherwise as a heartbeat, every ``heartbeat_seconds`` the coordinator set in its last reply,
  jittered so that a cluster's agents do not report in lockstep;
- a step's checksums go out until a coordinator acknowledged them, then never again unless a reply
  asks (``want_files``: the coordinator restarted or forgot them). Replicas never carry them;
- after a report failed, not before a jittered, exponentially growing delay: a coordinator that is
  overloaded or restarting must not meet every agent again a second later, each with a new TLS
  handshake (a timed-out request loses its connection).

No I/O: the node agent and the coordinator scale bench's simulated nodes share it.
"""

import asyncio
import random
from collections.abc import Iterable, Mapping

import msgspec

from replicator.local_tier import frameworks
from replicator.node.notices import NodeNotices
from replicator.pacing import timing
from replicator.wire.messages import (
    PROTOCOL_VERSION,
    BackedUp,
    Files,
    HeldShard,
    HeldStep,
    JobRef,
    Lineage,
    NodeReport,
    PodReport,
    ReportReply,
)


class HeldCopy(msgspec.Struct, frozen=True, gc=False):
    """A copy the node holds of ``rank``'s ``step`` of ``job``, written in ``timeline``: a replica,
    or the node's own data (``OwnStep``). The coordinator's view of a copy, wherever held, is
    ``planner.StepCopy``. A replica's ``content`` is ``messages.files_digest`` of its checksums."""

    job: JobRef
    step: int
    rank: int
    timeline: int = 0
    content: int | None = None


class OwnStep(msgspec.Struct, frozen=True, gc=False):
    """A committed step of the node's own data, with its checksums (relative path -> (size, CRC32C))."""

    copy: HeldCopy
    files: Files


def report_shape(report: NodeReport) -> tuple:
    """What a report says, checksums aside: a report that says the same again is a heartbeat."""
    held = tuple((h.namespace, h.job, h.step, h.rank, h.timeline, h.replica) for h in report.held)
    return report.url, report.pods, held, report.backed_up, report.topology, report.lineages, report.shards


class ReportSession:
    """What the coordinator has acknowledged, and when the next heartbeat is due.

    Args:
      node_id, url, pod_address, topology, replicas, has_backup: what the node says about itself
        (see ``NodeReport``).
      notices: the node's notices, sent with each report until acknowledged (a notice pokes a report).
    """

    def __init__(
        self,
        node_id: str,
        url: str,
        pod_address: str | None,
        topology: dict[str, str],
        replicas: int,
        has_backup: bool,
        redundancy: str = "replicas",
        notices: NodeNotices | None = None,
    ):
        self.notices = notices or NodeNotices()
        self.notices.poke = self.poke
        self._identity = (node_id, url, pod_address, topology)
        self._replicas = replicas
        self._redundancy = redundancy
        self._has_backup = has_backup
        self._sent_files: set[HeldCopy] = set()
        self._signatures: dict[HeldCopy, str | None] = {}
        self._acknowledged: tuple | None = None
        self._next_heartbeat = float("-inf")
        self._failures = 0
        self._retry_at = float("-inf")
        self.poked = True
        self.wake = asyncio.Event()  # set to end the report loop's wait between rounds
        self._loop: asyncio.AbstractEventLoop | None = None
        self.heartbeat_seconds = 1.0
        self.list_backups: set[JobRef] = set()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Names the event loop that ``poke`` wakes (the report loop's, once it runs)."""
        self._loop = loop

    def poke(self) -> None:
        """Asks for a report now; safe to call from any thread (the gRPC servicer's). A no-op until ``bind``."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._poke_now)

    def _poke_now(self) -> None:
        self.poked = True
        self.wake.set()

    def build(
        self,
        pods: Iterable[PodReport],
        own: Iterable[OwnStep],
        replicas: Iterable[HeldCopy],
        backed_up: Iterable[BackedUp],
        waiting: bool,
        lineages: Iterable[Lineage] = (),
        job_frameworks: Mapping[JobRef, frameworks.Framework] | None = None,
        shards: Iterable[HeldShard] = (),
    ) -> NodeReport:
        """The node's report.

        Args:
          pods: the pods published on the node.
          own: every committed step of the node's own data.
          replicas: every replica it holds.
          backed_up: its latest listings of backup tiers.
          waiting: a pod of the node waits for its assignment (the coordinator may hold the reply).
          lineages: the rollbacks of its jobs it knows of.
          job_frameworks: job -> the job's framework, which signs its steps
            (``Framework.logical_signature``); a job not listed is ``frameworks.DEFAULT``'s.
          shards: the parity shards it holds.
        """
        held = self._own_steps(own, job_frameworks or {})
        held.extend(
            HeldStep(r.job.namespace, r.job.job, r.step, r.rank, replica=True, timeline=r.timeline, content=r.content)
            for r in replicas
        )
        return NodeReport(
            *self._identity,
            tuple(pods),
            tuple(held),
            self._replicas,
            tuple(backed_up),
            self._has_backup,
            protocol=PROTOCOL_VERSION,
            waiting=waiting,
            lineages=tuple(lineages),
            redundancy=self._redundancy,
            shards=tuple(shards),
            notices=self.notices.pending(),
        )

    def _own_steps(
        self, own: Iterable[OwnStep], job_frameworks: Mapping[JobRef, frameworks.Framework]
    ) -> list[HeldStep]:
        """The held steps of the node's own data: checksums until sent once, signatures computed once per step."""
        held, keys = [], set()
        for own_step in own:
            key, files = own_step.copy, own_step.files
            keys.add(key)
            if key not in self._signatures:
                framework = job_frameworks.get(key.job) or frameworks.get(frameworks.DEFAULT)
                self._signatures[key] = framework.logical_signature(files)
            held.append(
                HeldStep(
                    key.job.namespace,
                    key.job.job,
                    key.step,
                    key.rank,
                    None if key in self._sent_files else files,
                    signature=self._signatures[key],
                    timeline=key.timeline,
                )
            )
        self._signatures = {k: v for k, v in self._signatures.items() if k in keys}
        self._sent_files &= keys
        return held

    def due(self, report: NodeReport, now: float) -> bool:
        """Whether ``report`` should be sent at ``now`` (monotonic seconds)."""
        if now < self._retry_at:
            return False
        return self.poked or report_shape(report) != self._acknowledged or now >= self._next_heartbeat

    def acknowledge(self, report: NodeReport, reply: ReportReply, now: float) -> None:
        """Records the coordinator's answer to ``report``, received at ``now`` (monotonic seconds)."""
        self.notices.sent(report.notices)
        self.poked = reply.want_files or bool(self.notices.pending())  # a notice taken while this report flew
        self._failures, self._retry_at = 0, float("-inf")
        self._acknowledged = report_shape(report)
        self.heartbeat_seconds = reply.heartbeat_seconds
        self._next_heartbeat = now + reply.heartbeat_seconds * random.uniform(0.8, 1.0)
        if reply.want_files:
            self._sent_files.clear()
        else:
            self._sent_files.update(
                HeldCopy(JobRef(h.namespace, h.job), h.step, h.rank, h.timeline)
                for h in report.held
                if h.files is not None
            )
        self.list_backups = set(reply.list_backups)

    def failed(self, now: float) -> None:
        """A report sent at ``now`` (monotonic seconds) got no reply: it goes again, whatever changes,
        after ``REPORT_RETRY_FIRST_SECONDS`` doubling with each failure up to ``REPORT_RETRY_MAX_SECONDS``,
        times U(0.5, 1) so that a cluster's agents spread out."""
        self._failures += 1
        backoff = min(
            timing.REPORT_RETRY_MAX_SECONDS, timing.REPORT_RETRY_FIRST_SECONDS * 2 ** min(self._failures - 1, 16)
        )
        self._retry_at = now + backoff * random.uniform(0.5, 1.0)
        self.poked = True
