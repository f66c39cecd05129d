"""The coordinator at scale: one real ``mtc coordinator`` process, N simulated node agents, goals of issue 9.

(Over 500 lines on purpose: one runnable bench whose simulated agents, phases and goal table read
best together.)

The coordinator runs as in production (``examples.local_cluster.CoordinatorProcess``: HTTPS with a
self-signed certificate, the cluster token required). A load generator in this process simulates N
node agents on one asyncio loop. Each agent reports through the node's own code: ``ReportSession``
(``replicator/node/report_session.py``) decides what a report says and when it is due (at once on a
change, else as a heartbeat at the ``heartbeat_seconds`` the coordinator returns, jittered), and
``CoordinatorClient`` (``replicator/wire/coordinator_client.py``) serialises and posts it, records the job's
settings and runs the restore calls (long polls included). Each agent owns its own keep-alive HTTPS
connections, at most two (its report loop and its restore calls), as a real agent does: a pool shared
by the agents and smaller than N would queue the publish and restore long polls behind each other
(the coordinator holds them until the whole job answered), so the bench raises its open-file limit.
Where the machine's hard limit cannot hold two per agent at both ends (20,000 here: N = 10,000),
each agent gets one, and its restore calls and reports take turns on it (printed).

What each simulated agent holds and does, as the real agent would:
- one pod of one job; a rank's step is ``FILES_PER_STEP`` Orbax-like files (``agent_idle.step_files``),
  checksums and the data-parallel signature as the real manifest gives them (data-parallel peers share
  the structural files, not the array bytes);
- the job trained before the bench: every rank holds its last ``HELD_STEPS`` steps and commits a new one
  every ``STEP_SECONDS``, staggered over the ranks; Orbax keeps ``HELD_STEPS``;
- it obeys the replies: replicate orders land on the target after ``PUSH_SECONDS``, retain orders delete,
  backup orders upload in ``UPLOAD_SECONDS`` and the rank completing a step lists the store at once;
  the job's designated lister lists every ``LIST_INTERVAL_SECONDS`` (the agent's interval).

Scenarios, for each ``--nodes`` N:
- steady: one job of N/250 slices x 250 nodes (data parallelism = slices, as Orbax's peer ranks say);
  after settling, a window of ``--seconds``;
- many jobs: a fresh coordinator, N/8 jobs of 8 nodes (one slice, one replica each), the same window;
- new incarnation: every pod of the steady job replaced at once: seconds from the last publish until
  every pod holds its assignment;
- restore: the new incarnation's ranks ask for their restore, stage the planned step and long-poll:
  seconds from the last rank's staged report until every rank saw ``ready``;
- restart (issue 54): a fresh steady job, settled; its coordinator SIGKILLed and started again at once on its state
  dir (``restart``): seconds from the kill until every node had a report answered and until the safe step advanced,
  and the deletions obeyed meanwhile, those of steps the job still needed apart (``SimCluster.needed``).

Figures: coordinator CPU (psutil, its process), its resident memory (at the end of the window, its
peak over the whole scenario, ``VmHWM``, and per node: the peak above what it held before any agent), offered and achieved report rates, report p99 latency,
the coordinator's event-loop lag p99 (``mtc_coordinator_loop_lag_seconds``), bytes/s of report bodies
received (``mtc_coordinator_report_bytes_total``), object-store list calls per job per hour, nodes
expired (the coordinator's "silent" log lines). The generator shares the machine's cores with the coordinator: its
own CPU, its event loop's lag and offered vs achieved are printed so that a saturated generator shows.
Its garbage collector is tuned as the coordinator's, the agents' state frozen once the cluster
formed, and the collector off while a window or the pod replacement is measured, so that the
generator's own pauses are not counted as the coordinator's latency.
"Offered" is what real agents would send: a report per change when it happens, else one per
``heartbeat_seconds`` x U(0.8, 1.0) rounded up to the agent's 1 s round, counted on an ideal clock per agent.

``python -m tests.bench.coordinator_scale --nodes 1000 [--nodes 4000 ...] [--seconds 60] [--scenarios restart]
[--log-dir DIR]`` exits 0 only when every goal at every N is met; it prints the machine's load average at the start
and the end of each N.
"""

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import gc
import math
import os
import resource
import shutil
import statistics
import sys
import time
import uuid
import zlib

import aiohttp
import msgspec
import psutil

from examples.local_cluster import CoordinatorProcess, scratch_dir, self_signed_certificate
from replicator.backup_tier import worker as backup_worker
from replicator.coordinator.api.process_tuning import GC_THRESHOLDS
from replicator.node.report_session import HeldCopy, OwnStep, ReportSession
from replicator.pacing import timing
from replicator.wire.bearer import Tokens
from replicator.wire.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from replicator.wire.messages import BackedUp, Files, JobRef, JobSettings, PodRank, PodReport, ReportReply
from tests.bench.agent_idle import step_files
from tests.helpers.ports import free_port

NAMESPACE = "bench"
SLICE_NODES = 250  # the steady job: N/250 slices of 250 nodes (40 x 250 at 10,000)
SMALL_JOB_NODES = 8  # many jobs: N/8 jobs of 8 nodes
STEP_SECONDS = 30.0  # every rank commits a step this often, staggered over the ranks
STEP_NUMBERS = 100  # step numbers advance by this per save
HELD_STEPS = 3
BACKUP_MINUTES = 30.0
PUSH_SECONDS = 2.0  # a replica lands this long after its order
UPLOAD_SECONDS = 5.0  # a rank's upload of a step takes this long
# The designated lister lists the job's backups this often (the agent's own interval).
LIST_INTERVAL_SECONDS = backup_worker._LIST_INTERVAL_SECONDS
ROUND_SECONDS = timing.ROUND_INTERVAL_SECONDS  # the agent's report round: a due heartbeat goes out at the next round
CONNECT_PER_SECOND = 2_000  # agents come up at this pace (the listen backlog is 128)
SCENARIO_TIMEOUT = 300.0
SETTLE_SECONDS = 20.0
KILL_LEAD_SECONDS = 2.0  # the restart's kill: this long before the step after the safe step is complete
KILL_TRIES = 5  # a kill that would come after the step is complete aims at the next step, this many times at most
CONNECTIONS_PER_AGENT = 2  # the report loop's and the restore's
SPARE_FILES = 1_000  # the coordinator's and the generator's other open files

GOAL_CPU = 50.0  # % of one core
GOAL_P99_MS = 250.0
GOAL_LIST_CALLS = 60.0  # per job per hour
GOAL_ASSIGN_SECONDS = 2.0
GOAL_READY_SECONDS = 5.0
GOAL_RESTART_SECONDS = 30.0  # from a coordinator's SIGKILL: every node answered, the safe step advanced (issue 54)
GOAL_KB_PER_NODE = 100.0  # coordinator memory per node: its peak resident above its idle own (issue 27)
_SILENT_LINE = ": no orders to it;"  # the coordinator's log line when a node turns silent


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job of ``slices`` x ``per_slice`` nodes; data parallelism = slices."""

    name: str
    slices: int
    per_slice: int

    @property
    def nodes(self) -> int:
        return self.slices * self.per_slice

    def settings(self, rank: int) -> JobSettings:
        """What the rank's ``replicator.yaml`` carries: its peers are the same in-slice index in every other slice."""
        worker = rank % self.per_slice
        peers = tuple(s * self.per_slice + worker for s in range(self.slices) if s * self.per_slice + worker != rank)
        return JobSettings(peers, self.slices, BACKUP_MINUTES, None)


def rank_files(step: int, rank: int, per_slice: int) -> Files:
    """One rank's step manifest: structural files equal across data-parallel peers, data files per rank."""
    structural = ("_METADATA", "_sharding", ".json")
    files = {}
    for path, size in step_files().items():
        owner = rank % per_slice if path.endswith(structural) else rank
        files[path] = (size, f"{zlib.crc32(f'{step}/{owner}/{path}'.encode()):08x}")
    return files


@dataclasses.dataclass
class RestartWatch:
    """What the agents see of a coordinator restart, from the SIGKILL (monotonic ``killed_at``).

    ``old_safe`` is the newest safe step a reply carried before the kill. A report counts as answered when it was
    sent after the kill (so the new process answered it); ``failures`` counts the reports that failed, by the
    client's error (``CoordinatorUnavailable``'s text: the exception's class or the HTTP status). ``deletions`` are
    the retain orders' deletions the agents obeyed from the kill until a reply carried a safe step past
    ``old_safe``: (node, step, "own" or "replica", why the job still needed it or None: ``SimCluster.needed``)."""

    killed_at: float
    old_safe: int
    answered: dict[str, float] = dataclasses.field(default_factory=dict)
    failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    advanced_at: float | None = None
    new_safe: int | None = None
    deletions: list[tuple[str, int, str, str | None]] = dataclasses.field(default_factory=list)

    def watching_deletions(self) -> bool:
        return self.advanced_at is None


class Stats:
    """What the generator measured; report figures count only inside the open window."""

    def __init__(self):
        self.window: tuple[float, float] | None = None
        self.latencies: list[float] = []
        self.lags: list[float] = []  # change -> report sent, seconds
        self.replies = 0
        self.offered = 0
        self.errors = 0
        self.list_calls = 0
        self.designations: set[tuple[JobRef, str]] = set()  # (job, lister node) seen in replies
        self.publish_sent: dict[str, float] = {}
        self.assigned: dict[str, float] = {}
        self.staged: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.safe: dict[int, float] = {}  # the job's safe step as its retain orders say (keep_from) -> first seen
        self.restart: RestartWatch | None = None

    def open(self, now: float, seconds: float) -> None:
        self.window = (now, now + seconds)
        self.latencies, self.lags, self.replies, self.offered, self.errors = [], [], 0, 0, 0
        self.list_calls, self.designations = 0, set()

    def inside(self, t: float) -> bool:
        return self.window is not None and self.window[0] <= t < self.window[1]


class SimAgent:
    """One simulated node agent holding one pod of ``job`` (see the module docstring)."""

    def __init__(self, cluster: "SimCluster", index: int, job: JobSpec, position: int):
        self.cluster, self.index, self.job, self.position = cluster, index, job, position
        self.node_id = f"node-{index:05d}"
        self.key = JobRef(NAMESPACE, job.name)
        self.session = ReportSession(
            self.node_id,
            f"https://{self.node_id}.sim:8470",
            None,
            {"block": f"b{index // SLICE_NODES}"},
            replicas=1,
            has_backup=True,
        )
        self.pod: PodReport | None = None
        self.own: dict[int, Files] = {}
        self.own_rank: int | None = None
        self.replicas: set[HeldCopy] = set()
        self.listing: dict[JobRef, BackedUp] = {}
        self.listed_at: dict[JobRef, float] = {}
        self.pushed: set[tuple] = set()
        self.uploaded: set[tuple] = set()
        self.training = False
        self.next_commit = float("inf")
        self.acknowledged_at = float("-inf")
        self.changed_at: float | None = None
        self.ideal_last = time.monotonic()  # the ideal agent's last report (offered rate)
        self.wake = asyncio.Event()
        # With one connection per agent, its restore calls and reports take turns on it; a request's
        # timeout starts with its turn, as it would on a connection of its own.
        self.turn: asyncio.Lock | contextlib.nullcontext = contextlib.nullcontext()
        self.client: CoordinatorClient | None = None
        self.http: aiohttp.ClientSession | None = None
        self.task: asyncio.Task | None = None
        self.training_task: asyncio.Task | None = None

    # -- what changes on the node ---------------------------------------------------------------

    def note_change(self) -> None:
        """Something the report says changed: the real agent reports at once."""
        now = time.monotonic()
        self._ideal_heartbeats(now)
        if self.cluster.stats.inside(now):
            self.cluster.stats.offered += 1
        self.ideal_last = now
        self.changed_at = self.changed_at or now
        self.wake.set()

    def _ideal_heartbeats(self, now: float) -> None:
        period = heartbeat_period(self.session.heartbeat_seconds)
        while self.ideal_last + period <= now:
            self.ideal_last += period
            self.cluster.stats.offered += self.cluster.stats.inside(self.ideal_last)

    def publish(self) -> None:
        """A new pod of the job on this node (kubelet's NodePublishVolume): it waits for its rank."""
        self.training, self.next_commit = False, float("inf")
        uid = uuid.uuid4().hex
        slice_index, worker = divmod(self.position, self.job.per_slice)
        self.pod = PodReport(
            NAMESPACE,
            self.job.name,
            f"{self.job.name}-slice-{slice_index}-{worker}-{uid[:5]}",
            uid,
            slice_index,
            worker,
            self.job.nodes,
            self.job.slices,
            8476,
            self.job.name,
            time.time(),
        )
        self.note_change()

    def _commit_if_due(self, now: float) -> None:
        if not self.training or now < self.next_commit:
            return
        step = self.cluster.step_at(self, now)
        self.own[step] = rank_files(step, self.own_rank, self.job.per_slice)
        for old in sorted(self.own)[:-HELD_STEPS]:
            del self.own[old]  # Orbax keeps its last HELD_STEPS
        self.next_commit = self.cluster.next_commit(self, now)
        self.note_change()

    def _list_if_due(self, now: float) -> None:
        for key in self.session.list_backups:
            if now - self.listed_at.get(key, float("-inf")) >= LIST_INTERVAL_SECONDS:
                self._list(key)

    def _list(self, key: JobRef) -> None:
        now = time.monotonic()
        self.listed_at[key] = now
        self.cluster.stats.list_calls += self.cluster.stats.inside(now)
        self.listing[key] = BackedUp(
            key.namespace, key.job, tuple((step, 0) for step in sorted(self.cluster.complete_backups(key))), time.time()
        )
        self.note_change()

    # -- the report loop ------------------------------------------------------------------------

    async def run(self) -> None:
        while not self.cluster.stopping:
            self.wake.clear()
            now = time.monotonic()
            self._commit_if_due(now)
            self._list_if_due(now)
            pod = self.pod
            own = [
                OwnStep(HeldCopy(self.key, step, self.own_rank), files) for step, files in self.own.items()
            ]  # timeline 0: no rollback
            waiting = pod.incarnation is None
            report = self.session.build([pod], own, self.replicas, self.listing.values(), waiting)
            if self.session.due(report, now):
                await self._send(report)
                continue
            # The agent's rounds come every ROUND_SECONDS; none before the jitter's lower bound can be due.
            rounds = math.ceil(0.8 * self.session.heartbeat_seconds / ROUND_SECONDS)
            earliest = self.acknowledged_at + rounds * ROUND_SECONDS
            check = earliest if now < earliest else now + ROUND_SECONDS
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(check, self.next_commit) - now)):
                    await self.wake.wait()

    async def _send(self, report) -> None:
        stats = self.cluster.stats
        started = time.monotonic()
        if self.changed_at is not None and stats.inside(started):
            stats.lags.append(started - self.changed_at)
        self.changed_at = None
        if report.waiting:
            stats.publish_sent.setdefault(self.pod.pod_uid, started)
        try:
            async with self.turn:
                reply = await self.client.report(report)
        except CoordinatorUnavailable as err:
            stats.errors += stats.inside(started)
            if stats.restart is not None:
                stats.restart.failures[failure_kind(err)] += 1
            self.session.failed(time.monotonic())  # the agent's backoff
            return
        done = time.monotonic()
        if stats.restart is not None and started >= stats.restart.killed_at:
            stats.restart.answered.setdefault(self.node_id, done)
        if stats.inside(done):
            stats.replies += 1
            stats.designations.update((j, self.node_id) for j in reply.list_backups)
            if not report.waiting:
                stats.latencies.append(done - started)
        self.session.acknowledge(report, reply, done)
        self.acknowledged_at = done
        self._obey(reply)

    def _obey(self, reply: ReportReply) -> None:
        assignment = next((a for a in reply.assignments if a.pod_uid == self.pod.pod_uid), None)
        if assignment is not None and assignment.incarnation != self.pod.incarnation:
            self.cluster.stats.assigned.setdefault(self.pod.pod_uid, time.monotonic())
            self.pod = msgspec.structs.replace(self.pod, incarnation=assignment.incarnation, rank=assignment.rank)
            self.training_task = asyncio.create_task(self._start_training())
            self.training_task.add_done_callback(self.cluster._died)
            self.note_change()
        for order in reply.replicate:
            for target in order.targets:
                key = (JobRef(order.namespace, order.job), order.rank, order.step, target.node)
                if key not in self.pushed:
                    self.pushed.add(key)
                    asyncio.get_running_loop().call_later(PUSH_SECONDS, self.cluster.land_replica, target.node, key)
        for order in reply.retain:
            dropped = [s for s in self.own if s < order.keep_from and s not in order.protected]
            job = JobRef(order.namespace, order.job)
            gone = {
                r for r in self.replicas if r.job == job and r.step < order.keep_from and r.step not in order.protected
            }
            if job == self.key:
                self.cluster.saw_safe(order.keep_from)
            self.cluster.note_deletions(self, job, dropped, gone)
            for step in dropped:
                del self.own[step]
            self.replicas -= gone
            if dropped or gone:
                self.note_change()
        for order in reply.backup:
            key = (order.namespace, order.job, order.step, order.rank, order.incarnation)
            if key not in self.uploaded:
                self.uploaded.add(key)
                asyncio.get_running_loop().call_later(
                    UPLOAD_SECONDS, self._uploaded, order.step, order.rank, order.nodes
                )

    def _uploaded(self, step: int, rank: int, nodes: int) -> None:
        if self.cluster.upload(self.key, step, rank, nodes):
            self._list(self.key)  # the rank that writes COMMIT lists at once

    # -- the pod's protocol: settings, restore, training ----------------------------------------

    async def _start_training(self) -> None:
        """Consumes ``replicator.yaml`` (records the settings), runs the restore, then trains."""
        pod = self.pod
        seat = PodRank(self.key, pod.incarnation, pod.rank)
        settings = self.job.settings(pod.rank)
        await self._retry(self.client.record_settings, seat, settings)
        self.pod = msgspec.structs.replace(self.pod, settings=settings)
        self.note_change()
        view = await self._retry(self.client.restore_view, seat)
        staged = None
        while view.step is not None and not view.ready:
            if view.generation != staged:
                source = view.sources[0]  # staged at once: the bench measures the coordinator, not the copy
                await self._retry(
                    self.client.report_staged, seat, view.generation, f"{source.tier}:{source.holder}", []
                )
                staged = view.generation
                self.cluster.stats.staged[pod.pod_uid] = time.monotonic()
            view = await self._retry(self.client.restore_view, seat, view.token)
        self.cluster.stats.ready[pod.pod_uid] = time.monotonic()
        if view.step is None:
            self.own = self.cluster.trained_before(self, pod.rank) if self.own_rank is None else {}
        elif self.own_rank != pod.rank:
            self.own = {view.step: rank_files(view.step, pod.rank, self.job.per_slice)}
        else:
            self.own = {s: f for s, f in self.own.items() if s <= view.step}  # newer steps set aside
        self.own_rank = pod.rank
        self.training = True
        self.next_commit = self.cluster.next_commit(self, time.monotonic())
        self.note_change()

    async def _retry(self, call, *args):
        while True:
            try:
                async with self.turn:
                    return await call(*args)
            except CoordinatorUnavailable:  # the agent retries (prefetch.restore, pod_handshake)
                await asyncio.sleep(timing.RESTORE_PLAN_RETRY_SECONDS)


class SimCluster:
    """N simulated agents against one coordinator; the backup store is a dict of uploaded ranks."""

    def __init__(self, coordinator: CoordinatorProcess, token: str, jobs: list[JobSpec]):
        self.coordinator, self.token = coordinator, token
        self.stats = Stats()
        self.agents: list[SimAgent] = []
        for job in jobs:
            for position in range(job.nodes):
                self.agents.append(SimAgent(self, len(self.agents), job, position))
        self.by_id = {a.node_id: a for a in self.agents}
        self.jobs = jobs
        self.epoch = time.monotonic() - HELD_STEPS * STEP_SECONDS  # the jobs trained before the bench
        self.bucket: dict[JobRef, dict[int, set[int]]] = {}
        self.complete: dict[JobRef, set[int]] = {}
        self.failure: BaseException | None = None
        self.stopping = False
        self.connections = connections_per_agent(len(self.agents))
        self.name = "cluster"  # its scenario's, in progress lines

    # -- the training clock ---------------------------------------------------------------------

    def _phase(self, agent: SimAgent) -> float:
        # Staggered over the cluster's nodes, so that the jobs do not save in lockstep either.
        return STEP_SECONDS * agent.index / len(self.agents)

    def step_at(self, agent: SimAgent, now: float) -> int:
        """The newest step the agent's rank committed by ``now``: its k-th save is at epoch + phase + k x STEP_SECONDS."""
        return STEP_NUMBERS * int((now - self.epoch - self._phase(agent)) // STEP_SECONDS)

    def next_commit(self, agent: SimAgent, now: float) -> float:
        return self.epoch + self._phase(agent) + (self.step_at(agent, now) // STEP_NUMBERS + 1) * STEP_SECONDS

    def trained_before(self, agent: SimAgent, rank: int) -> dict[int, Files]:
        """The steps the rank holds when the bench starts: the job trained before it."""
        newest = self.step_at(agent, time.monotonic())
        return {s: rank_files(s, rank, agent.job.per_slice) for s in range(newest, 0, -STEP_NUMBERS)[:HELD_STEPS]}

    # -- peers and the backup store -------------------------------------------------------------

    def land_replica(self, node_id: str, key: tuple[JobRef, int, int, str]) -> None:
        job, rank, step, _ = key
        target = self.by_id[node_id]
        target.replicas.add(HeldCopy(job, step, rank))
        target.note_change()

    def upload(self, key: JobRef, step: int, rank: int, nodes: int) -> bool:
        """Records a rank's upload; True when it completes the step (that rank writes COMMIT)."""
        ranks = self.bucket.setdefault(key, {}).setdefault(step, set())
        ranks.add(rank)
        if len(ranks) == nodes and step not in self.complete.setdefault(key, set()):
            self.complete[key].add(step)
            return True
        return False

    def complete_backups(self, key: JobRef) -> set[int]:
        return self.complete.get(key, set())

    def complete_at(self, step: int) -> float:
        """When the last rank commits ``step`` (the latest phase), monotonic seconds."""
        return (
            self.epoch + STEP_SECONDS * (len(self.agents) - 1) / len(self.agents) + step // STEP_NUMBERS * STEP_SECONDS
        )

    # -- what a restart may break ---------------------------------------------------------------

    def saw_safe(self, step: int) -> None:
        """A reply carried ``step`` as the job's safe step (its retain order's ``keep_from``)."""
        now = time.monotonic()
        self.stats.safe.setdefault(step, now)
        watch = self.stats.restart
        if watch is not None and watch.advanced_at is None and step > watch.old_safe:
            watch.advanced_at, watch.new_safe = now, step

    def note_deletions(self, agent: SimAgent, job: JobRef, own: list[int], replicas: set[HeldCopy]) -> None:
        """Records what a retain order deletes while a restart is watched, and whether the job still needed it."""
        watch = self.stats.restart
        if watch is None or not watch.watching_deletions():
            return
        for step, kind in [(s, "own") for s in own] + [(r.step, "replica") for r in replicas]:
            watch.deletions.append((agent.node_id, step, kind, self.needed(job, step, watch.old_safe)))

    def needed(self, job: JobRef, step: int, safe: int) -> str | None:
        """Why the job still needs the nodes' copies of ``step`` while ``safe`` is its newest safe step, or None:
        "safe or newer" (the safe step is what a restore falls back to; a newer one is not safe yet, so a lost
        rank's copy may be its last) or "uploading" (a backup of it ordered and not complete: its upload reads
        the local files). The newest complete backup is not in it: the store holds it whole, and the retention
        rule frees its local copies once a newer step is safe (``retention.safe_step``)."""
        if step >= safe:
            return "safe or newer"
        return "uploading" if step in set(self.bucket.get(job, {})) - self.complete_backups(job) else None

    # -- phases ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connects every agent (at ``CONNECT_PER_SECOND``) and publishes its pod; returns once every
        pod trained from its fresh start."""
        context = self.coordinator.ssl_context()
        timeout = aiohttp.ClientTimeout(total=None)  # the client sets each request's
        for index, agent in enumerate(self.agents):
            connector = aiohttp.TCPConnector(
                ssl=context, limit=self.connections, keepalive_timeout=timing.COORDINATOR_KEEPALIVE_SECONDS
            )
            agent.http = aiohttp.ClientSession(connector=connector, timeout=timeout)
            agent.turn = asyncio.Lock() if self.connections == 1 else contextlib.nullcontext()
            agent.client = CoordinatorClient(agent.http, self.coordinator.url, Tokens.of(self.token))
            agent.publish()
            agent.task = asyncio.create_task(agent.run())
            agent.task.add_done_callback(self._died)
            if index % 100 == 99:
                await asyncio.sleep(100 / CONNECT_PER_SECOND)
        await self.until(lambda: sum(a.training for a in self.agents), "pods train")

    def _died(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()

    async def until(self, count, what: str) -> None:
        """Waits until ``count()`` reaches the number of agents. Raises TimeoutError (saying how many
        got there), or an agent's loop's exception."""
        deadline = time.monotonic() + SCENARIO_TIMEOUT
        while (done := count()) < len(self.agents):
            if self.failure is not None:
                raise RuntimeError("a simulated agent failed") from self.failure
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {done:,} of {len(self.agents):,} within {SCENARIO_TIMEOUT:g} s")
            await asyncio.sleep(0.1)

    async def stop_agents(self) -> None:
        self.stopping = True
        tasks = [t for a in self.agents for t in (a.task, a.training_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close_sessions(self) -> None:
        await asyncio.gather(*(a.http.close() for a in self.agents if a.http))

    def heartbeat_seconds(self) -> float:
        return max(a.session.heartbeat_seconds for a in self.agents)


class LoopLag:
    """The generator's event loop lag: how late a 0.1 s sleep wakes, sampled while it runs."""

    def __init__(self):
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _sample(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(0.1)
            self.samples.append(time.monotonic() - started - 0.1)

    def __enter__(self):
        self._task = asyncio.create_task(self._sample())
        return self

    def __exit__(self, *_):
        self._task.cancel()


@contextlib.contextmanager
def collector_paused():
    """The generator's garbage collector off while it measures: its pauses (up to 250 ms at 10,000
    agents, tuned as the coordinator's) were counted as the coordinator's latency. The agents' requests
    leave no reference cycles, so little garbage waits (the window's growth of the generator's memory
    is printed)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def connections_per_agent(nodes: int) -> int:
    """Two, as a real agent has; one when the coordinator could not hold two per agent under this
    machine's open-file hard limit (each connection is a file at both ends; the limit binds both
    processes). With one, an agent's restore long poll and its reports take turns."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    fits = hard == resource.RLIM_INFINITY or CONNECTIONS_PER_AGENT * nodes + SPARE_FILES <= hard
    return CONNECTIONS_PER_AGENT if fits else 1


@functools.cache  # statistics.mean works in fractions: per change and agent it was 7 % of the generator
def heartbeat_period(heartbeat_seconds: float) -> float:
    """The mean interval of a real agent's heartbeats: due after heartbeat x U(0.8, 1.0), sent at
    the next of its rounds."""
    jitters = (0.8 + 0.2 * (i + 0.5) / 100 for i in range(100))
    return statistics.mean(math.ceil(heartbeat_seconds * j / ROUND_SECONDS) * ROUND_SECONDS for j in jitters)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else float("nan"))


_REPORT_BYTES = "mtc_coordinator_report_bytes_total"
_LAG_BUCKET = "mtc_coordinator_loop_lag_seconds_bucket"


async def scrape(coordinator: CoordinatorProcess) -> dict[str, float]:
    """The coordinator's ``/metrics``: sample (name with labels) -> value."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(coordinator.url + "/metrics", ssl=coordinator.ssl_context()) as response,
    ):
        text = await response.text()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))
    }


def lag_p99(before: dict[str, float], after: dict[str, float]) -> float:
    """The upper bound of the histogram bucket holding the 99th percentile of the coordinator's
    event-loop lag between two scrapes, seconds (infinite past the last bucket)."""
    counts = sorted(
        (float(name.split('le="')[1].rstrip('"}')), after[name] - before.get(name, 0.0))
        for name in after
        if name.startswith(_LAG_BUCKET)
    )
    return next((bound for bound, count in counts if count >= 0.99 * counts[-1][1]), math.inf)


def silent_lines(coordinator: CoordinatorProcess) -> int:
    with open(coordinator.log_path, encoding="utf-8", errors="replace") as log:
        return sum(_SILENT_LINE in line for line in log)


async def steady_window(cluster: SimCluster, seconds: float) -> dict:
    """Lets the cluster settle, then measures a window of ``seconds``; returns the figures."""
    stats = cluster.stats
    hb = cluster.heartbeat_seconds()
    # Every agent at the coordinator's pace, its files acknowledged, the first replicas landed and collected.
    await asyncio.sleep(max(SETTLE_SECONDS, 2 * hb))
    coordinator, generator = psutil.Process(cluster.coordinator.process.pid), psutil.Process()
    silent_before = silent_lines(cluster.coordinator)
    before = await scrape(cluster.coordinator)
    cpu = [sum(p.cpu_times()[:2]) for p in (coordinator, generator)]
    started = time.monotonic()
    stats.open(started, seconds)
    rss = generator.memory_info().rss
    with LoopLag() as lag, collector_paused():
        await asyncio.sleep(seconds)
    rss_growth = generator.memory_info().rss - rss
    for agent in cluster.agents:
        agent._ideal_heartbeats(started + seconds)
    wall = time.monotonic() - started
    coordinator_cpu, generator_cpu = (
        100 * (sum(p.cpu_times()[:2]) - c) / wall for p, c in zip((coordinator, generator), cpu)
    )
    after = await scrape(cluster.coordinator)
    stats.window = None
    # Per job and hour: every node the coordinator designated lister in the window lists every
    # LIST_INTERVAL_SECONDS, and the rank that completes a backup (every BACKUP_MINUTES) lists once.
    listers = len(stats.designations) / len(cluster.jobs)
    list_calls = listers * 3600 / LIST_INTERVAL_SECONDS + 60 / BACKUP_MINUTES
    return {
        "coordinator_cpu": coordinator_cpu,
        "coordinator_rss": coordinator.memory_info().rss,
        "offered": stats.offered / seconds,
        "achieved": stats.replies / seconds,
        "p99_ms": 1000 * p99(stats.latencies),
        "bytes_per_second": (after[_REPORT_BYTES] - before[_REPORT_BYTES]) / wall,
        "coordinator_lag_p99": lag_p99(before, after),
        "list_calls": list_calls,
        "listers_per_job": listers,
        "listed_in_window": stats.list_calls,
        "expired": silent_lines(cluster.coordinator) - silent_before,
        "errors": stats.errors,
        "heartbeat_seconds": hb,
        "generator_cpu": generator_cpu,
        "lag_p99": p99(stats.lags),
        "loop_lag_p99": p99(lag.samples),
        "held_per_rank": statistics.mean(len(a.own) for a in cluster.agents),
        "generator_rss_growth": rss_growth,
    }


async def replace_every_pod(cluster: SimCluster) -> dict:
    """Publishes a new pod on every node at once (a job restart) and lets each run its protocol.

    Returns:
      assign_seconds: from the last publish report sent until every pod holds its assignment;
      publish_spread: from the first to the last publish report sent (the generator's pace);
      ready_seconds: from the last staged report until every rank saw ``ready``.
    A phase not reached within ``SCENARIO_TIMEOUT`` is infinite (a missed goal), and the bench goes on.
    """
    stats = cluster.stats
    for agent in cluster.agents:
        agent.publish()
    uids = [a.pod.pod_uid for a in cluster.agents]
    figures = {"assign_seconds": math.inf, "publish_spread": math.nan, "ready_seconds": math.inf}
    try:
        await cluster.until(lambda: sum(u in stats.assigned for u in uids), "new pods assigned")
        sent = [stats.publish_sent[u] for u in uids]
        figures |= {
            "assign_seconds": max(stats.assigned[u] for u in uids) - max(sent),
            "publish_spread": max(sent) - min(sent),
        }
        await cluster.until(lambda: sum(u in stats.ready for u in uids), "ranks ready")
    except TimeoutError as err:
        progress(f"{err}: recorded as missed")
        return figures
    if not all(u in stats.staged for u in uids):
        raise RuntimeError("the restore planned no step: the job's held steps did not reach the coordinator")
    return figures | {"ready_seconds": max(stats.ready[u] for u in uids) - max(stats.staged[u] for u in uids)}


def start_coordinator(workdir: str) -> tuple[CoordinatorProcess, str]:
    os.makedirs(workdir)
    token_file = os.path.join(workdir, "token")
    token = uuid.uuid4().hex
    with open(token_file, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    coordinator = CoordinatorProcess(
        workdir,
        f"127.0.0.1:{free_port('127.0.0.1')}",
        ["--token-file", token_file],
        tls=self_signed_certificate(os.path.join(workdir, "tls")),
    )
    return coordinator.start(), token


async def run_cluster(workdir: str, jobs: list[JobSpec], cleanup, measure, log_copy: str | None) -> dict:
    """Forms ``jobs`` against a fresh coordinator, then returns its figures and ``await measure(cluster)``'s; its
    log is copied to ``log_copy`` (a path) at the end, unless None."""
    coordinator, token = start_coordinator(workdir)
    cleanup.callback(coordinator.stop)
    idle_rss = psutil.Process(coordinator.process.pid).memory_info().rss  # before any agent: the process's own
    cluster = SimCluster(coordinator, token, jobs)
    cluster.name = os.path.basename(workdir)
    try:
        formed = time.monotonic()
        await cluster.start()
        gc.freeze()  # the agents' state, formed: the generator's collections need not walk it again
        progress(
            f"{cluster.name}: {len(cluster.agents)} agents in {len(jobs)} jobs trained after {time.monotonic() - formed:.0f} s; settling, then measuring"
        )
        figures = {
            "formed_seconds": time.monotonic() - formed,
            "connections": cluster.connections,
            "coordinator_idle_rss": idle_rss,
        }
        return figures | await measure(cluster)
    finally:
        progress(f"{cluster.name}: stopping")
        gc.unfreeze()  # what this cluster leaves behind is collected before the next
        await cluster.stop_agents()
        coordinator.stop()  # first: closing N TLS sessions to a live peer took minutes
        await cluster.close_sessions()
        if log_copy is not None:
            shutil.copyfile(coordinator.log_path, log_copy)


async def window_then_replace(cluster: SimCluster, seconds: float, replace: bool) -> dict:
    """The steady and many-jobs scenarios: a window of ``seconds``, then (``replace``) every pod replaced."""
    figures = await steady_window(cluster, seconds)
    progress(f"{cluster.name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()))
    if replace:
        progress(f"{cluster.name}: replacing every pod")
        with collector_paused():
            figures |= await replace_every_pod(cluster)
    return figures | {"coordinator_peak_rss": peak_rss(cluster.coordinator.process.pid)}


async def restart(cluster: SimCluster) -> dict:
    """SIGKILLs the settled coordinator and starts it again at once on the same address, certificate, token and
    ``--state-dir``, as a Deployment's restart would (a real one adds what is not measured here: the pod's
    rescheduling, its image pull and container start, and a Service's endpoints turning over).

    The kill is aimed ``KILL_LEAD_SECONDS`` before the last rank commits the step after the safe step
    (``kill_time``; a lagging generator that would kill after that commit aims at the next step): without the
    restart the safe step would advance about then, so what the restart adds shows instead of up to a step
    interval of training. Returns, in seconds from the kill (infinite: not within ``SCENARIO_TIMEOUT``):
    up_seconds (the new process answers ``/healthz``), answered_seconds (every node had a report answered),
    safe_seconds (a reply carried a safe step past the one before the kill), complete_seconds (the step after it
    was committed by every rank); and the deletions ordered meanwhile, the new process's CPU (% of a core, from the
    kill to the later of the two) and peak memory, the generator's CPU and loop lag p99.
    """
    stats, coordinator = cluster.stats, cluster.coordinator
    await asyncio.sleep(max(SETTLE_SECONDS, 2 * cluster.heartbeat_seconds()))
    for _ in range(KILL_TRIES):  # a lagging generator loop wakes late: then it aims at the next step
        kill_at = await kill_time(cluster)
        await asyncio.sleep(kill_at - time.monotonic())
        if (late := time.monotonic() - kill_at) < KILL_LEAD_SECONDS:
            break
        progress(f"{cluster.name}: {late:.1f} s late for the kill, after the step completed: aiming at the next one")
    old_safe = max(stats.safe)
    generator, generator_cpu = psutil.Process(), sum(psutil.Process().cpu_times()[:2])
    progress(f"{cluster.name}: SIGKILL with the safe step at {old_safe}; starting it again")
    with LoopLag() as lag, collector_paused():
        watch = stats.restart = RestartWatch(time.monotonic(), old_safe)
        overflows = listen_overflows()
        coordinator.kill()
        figures = {"complete_seconds": cluster.complete_at(old_safe + STEP_NUMBERS) - watch.killed_at}
        await asyncio.to_thread(coordinator.start, SCENARIO_TIMEOUT)
        figures["up_seconds"] = time.monotonic() - watch.killed_at
        progress(f"{cluster.name}: the new coordinator answers /healthz {figures['up_seconds']:.2f} s after the kill")
        for what, count in (
            ("nodes answered", lambda: len(watch.answered)),
            ("safe step advanced", lambda: len(cluster.agents) * (watch.advanced_at is not None)),
        ):
            with contextlib.suppress(TimeoutError):
                await cluster.until(count, what)
        ended = time.monotonic()
    wall = ended - watch.killed_at
    new = psutil.Process(coordinator.process.pid)
    answered = len(watch.answered) == len(cluster.agents)
    return figures | {
        "answered_seconds": max(watch.answered.values()) - watch.killed_at if answered else math.inf,
        "answered_nodes": len(watch.answered),
        "safe_seconds": watch.advanced_at - watch.killed_at if watch.advanced_at is not None else math.inf,
        "old_safe": old_safe,
        "new_safe": watch.new_safe,
        "failures": watch.failures,
        "listen_overflows": listen_overflows() - overflows,
        "newest_backup": max(cluster.complete_backups(cluster.agents[0].key), default=None),
        "deletions": watch.deletions,
        "coordinator_cpu": 100 * sum(new.cpu_times()[:2]) / wall,
        "coordinator_rss": new.memory_info().rss,
        "coordinator_peak_rss": peak_rss(new.pid),
        "generator_cpu": 100 * (sum(generator.cpu_times()[:2]) - generator_cpu) / wall,
        "loop_lag_p99": p99(lag.samples),
        "heartbeat_seconds": cluster.heartbeat_seconds(),
    }


async def kill_time(cluster: SimCluster) -> float:
    """``KILL_LEAD_SECONDS`` before the last rank commits the step after the newest safe step a reply carried,
    monotonic seconds; waits for the safe step to catch up with the training where that is already past.

    Raises:
      TimeoutError: no reply carried a safe step the training had not already passed within ``SCENARIO_TIMEOUT``.
    """
    deadline = time.monotonic() + SCENARIO_TIMEOUT
    while time.monotonic() < deadline:
        if cluster.stats.safe:
            kill_at = cluster.complete_at(max(cluster.stats.safe) + STEP_NUMBERS) - KILL_LEAD_SECONDS
            if kill_at > time.monotonic():
                return kill_at
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the safe step did not keep up with the training within {SCENARIO_TIMEOUT:g} s")


def listen_overflows() -> int:
    """Connections this machine's kernel dropped at a full accept queue so far (``TcpExt: ListenOverflows``, every
    listening socket's: the coordinator's is the one under load here); the client's SYN is sent again 1 s later,
    then 3 s, 7 s..."""
    with open("/proc/net/netstat", encoding="ascii") as f:
        tcp_ext = [line.split()[1:] for line in f if line.startswith("TcpExt:")]
    return int(dict(zip(*tcp_ext))["ListenOverflows"])


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, bytes (Linux's ``VmHWM``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def judge(nodes: int, results: dict[str, dict]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, value, goal, met or None for no goal) rows for one N, of the scenarios in ``results``."""
    rows = []
    for scenario, name in (("steady", "steady"), ("many", "many jobs")):
        if scenario in results:
            rows += window_rows(nodes, name, results[scenario])
    if "steady" in results:
        rows += incarnation_rows(results["steady"])
    if "restart" in results:
        rows += restart_rows(nodes, results["restart"])
    return rows


def per_node_kb(nodes: int, f: dict) -> float:
    """KB of the coordinator's peak resident memory per node, above what it held idle."""
    return (max(f["coordinator_rss"], f["coordinator_peak_rss"]) - f["coordinator_idle_rss"]) / nodes / 1e3


def generator_line(f: dict) -> str:
    bound = f["achieved"] < 0.95 * f["offered"] if "achieved" in f else False
    bound = bound or f["generator_cpu"] >= 90 or f["loop_lag_p99"] > 0.25
    return f"{f['generator_cpu']:.0f} % of a core, loop lag p99 {1000 * f['loop_lag_p99']:.0f} ms" + (
        ": GENERATOR-BOUND" if bound else ""
    )


def window_rows(nodes: int, name: str, f: dict) -> list[tuple[str, str, str, bool | None]]:
    """The rows of a steady window (the steady job's or the many jobs')."""
    return [
        (
            f"{name}: coordinator CPU",
            f"{f['coordinator_cpu']:.1f} % of a core",
            f"<= {GOAL_CPU:g} %",
            f["coordinator_cpu"] <= GOAL_CPU,
        ),
        (
            f"{name}: coordinator memory",
            f"{f['coordinator_rss'] / 2**20:.0f} MiB resident (peak {f['coordinator_peak_rss'] / 2**20:.0f} MiB, "
            f"idle {f['coordinator_idle_rss'] / 2**20:.0f} MiB): {per_node_kb(nodes, f):.0f} KB per node",
            f"<= {GOAL_KB_PER_NODE:g} KB per node",
            per_node_kb(nodes, f) <= GOAL_KB_PER_NODE,
        ),
        (
            f"{name}: coordinator CPU per report",
            f"{10 * f['coordinator_cpu'] / max(f['achieved'], 1):.2f} ms (report handling plus the decision passes)",
            "-",
            None,
        ),
        (
            f"{name}: report p99 latency",
            f"{f['p99_ms']:.0f} ms",
            f"<= {GOAL_P99_MS:g} ms",
            f["p99_ms"] <= GOAL_P99_MS,
        ),
        (
            f"{name}: coordinator event-loop lag p99",
            f"<= {1000 * f['coordinator_lag_p99']:.0f} ms (its ticker; what every request waited besides its own handling)",
            "-",
            None,
        ),
        (f"{name}: nodes expired", f"{f['expired']}", "0", f["expired"] == 0),
        (
            f"{name}: list calls per job per hour",
            f"{f['list_calls']:.1f} ({f['listers_per_job']:.2f} listers/job; {f['listed_in_window']} lists in the window)",
            f"<= {GOAL_LIST_CALLS:g}",
            f["list_calls"] <= GOAL_LIST_CALLS,
        ),
        (
            f"{name}: reports offered / achieved",
            f"{f['offered']:.0f} / {f['achieved']:.0f} per s (heartbeat {f['heartbeat_seconds']:g} s, "
            f"{f['errors']} errors)",
            "achieved ~ offered",
            None,
        ),
        (f"{name}: bytes received", f"{f['bytes_per_second'] / 1e3:.0f} kB/s of report bodies", "-", None),
        (
            f"{name}: load generator",
            f"{generator_line(f)}; change->send p99 {f['lag_p99']:.2f} s, "
            f"memory +{f['generator_rss_growth'] / 2**20:.0f} MiB with its collector off",
            "-",
            None,
        ),
        (
            f"{name}: held steps per rank, formed in",
            f"{f['held_per_rank']:.2f}, {f['formed_seconds']:.0f} s "
            f"({f['connections']} connection{'s' if f['connections'] > 1 else ''} per agent)",
            "-",
            None,
        ),
    ]


def incarnation_rows(f: dict) -> list[tuple[str, str, str, bool | None]]:
    """The new incarnation's and its restore's rows (the steady job's pods replaced)."""
    return [
        (
            "new incarnation: last publish -> all assigned",
            f"{seconds(f['assign_seconds'])} (publishes sent over {f['publish_spread']:.2f} s)",
            f"<= {GOAL_ASSIGN_SECONDS:g} s",
            f["assign_seconds"] <= GOAL_ASSIGN_SECONDS,
        ),
        (
            "restore: last staged -> all ready",
            seconds(f["ready_seconds"]),
            f"<= {GOAL_READY_SECONDS:g} s",
            f["ready_seconds"] <= GOAL_READY_SECONDS,
        ),
    ]


def restart_rows(nodes: int, f: dict) -> list[tuple[str, str, str, bool | None]]:
    """The coordinator restart's rows (``restart``)."""
    deletions = f["deletions"]
    needed = collections.Counter(d[3] for d in deletions if d[3])
    kinds = {kind: sum(d[2] == kind for d in deletions) for kind in ("own", "replica")}
    steps = collections.Counter(d[1] for d in deletions)
    failures = ", ".join(f"{n:,} {kind}" for kind, n in f["failures"].most_common())
    return [
        (
            "restart: SIGKILL -> every node answered",
            f"{seconds(f['answered_seconds'])} ({f['answered_nodes']:,} of {nodes:,}; back up in {f['up_seconds']:.2f} s, "
            f"reports failed: {failures or 'none'}; {f['listen_overflows']:,} connections dropped at the full accept queue)",
            f"<= {GOAL_RESTART_SECONDS:g} s",
            f["answered_seconds"] <= GOAL_RESTART_SECONDS,
        ),
        (
            "restart: SIGKILL -> safe step advanced",
            f"{seconds(f['safe_seconds'])} ({f['old_safe']} -> {f['new_safe']}; step {f['old_safe'] + STEP_NUMBERS} "
            f"complete on every rank {f['complete_seconds']:.2f} s after the kill)",
            f"<= {GOAL_RESTART_SECONDS:g} s",
            f["safe_seconds"] <= GOAL_RESTART_SECONDS,
        ),
        (
            "restart: needed steps deleted meanwhile",
            f"{sum(needed.values())} ({', '.join(f'{n} {why}' for why, n in needed.items()) or 'none needed'}; "
            f"ordered: {kinds['own']} own copies, {kinds['replica']} replicas, by step {dict(sorted(steps.items()))}; "
            f"newest complete backup {f['newest_backup']})",
            "0",
            not needed,
        ),
        (
            "restart: coordinator CPU, memory",
            f"{f['coordinator_cpu']:.0f} % of a core; {f['coordinator_rss'] / 2**20:.0f} MiB resident "
            f"(peak {f['coordinator_peak_rss'] / 2**20:.0f} MiB): {per_node_kb(nodes, f):.0f} KB per node",
            "-",
            None,
        ),
        ("restart: load generator", generator_line(f) + f" (heartbeat {f['heartbeat_seconds']:g} s)", "-", None),
    ]


def seconds(value: float) -> str:
    return f"{value:.2f} s" if math.isfinite(value) else f"not within {SCENARIO_TIMEOUT:g} s"


def print_rows(nodes: int, rows) -> None:
    print(f"\n== N = {nodes:,} nodes")
    print(f"  {'figure':<46} {'measured':<70} {'goal':<18} verdict")
    for figure, value, goal, met in rows:
        print(f"  {figure:<46} {value:<70} {goal:<18} {'-' if met is None else 'met' if met else 'MISSED'}")


SCENARIOS = ("steady", "many", "restart")  # steady includes the new incarnation and its restore


async def bench(nodes: int, seconds: float, scenarios: tuple[str, ...], log_dir: str | None) -> list:
    if nodes % SLICE_NODES:
        raise SystemExit(f"--nodes must be a multiple of {SLICE_NODES}")
    steady_job = [JobSpec("steady", nodes // SLICE_NODES, SLICE_NODES)]
    measures = {
        "steady": (steady_job, functools.partial(window_then_replace, seconds=seconds, replace=True)),
        "many": (
            [JobSpec(f"small-{i}", 1, SMALL_JOB_NODES) for i in range(nodes // SMALL_JOB_NODES)],
            functools.partial(window_then_replace, seconds=seconds, replace=False),
        ),
        "restart": (steady_job, restart),
    }
    results = {}
    with scratch_dir("mtc-bench-scale-") as (workdir, cleanup):
        for scenario in scenarios:
            jobs, measure = measures[scenario]
            log_copy = os.path.join(log_dir, f"coordinator-{nodes}-{scenario}.log") if log_dir else None
            results[scenario] = await run_cluster(os.path.join(workdir, scenario), jobs, cleanup, measure, log_copy)
    return judge(nodes, results)


def scenario_list(text: str) -> tuple[str, ...]:
    """``--scenarios``: names from ``SCENARIOS``, comma-separated, run in that order."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or '(none)'}: pick from {', '.join(SCENARIOS)}"
        )
    return names


def failure_kind(err: CoordinatorUnavailable) -> str:
    """A failed request's kind: the client's exception class (``ServerDisconnectedError``, ``TimeoutError``...)
    or ``HTTP <status>``, from ``CoordinatorClient``'s message ``METHOD PATH: <repr or HTTP status>``."""
    detail = str(err).partition(": ")[2]
    return detail.partition(":")[0] if detail.startswith("HTTP") else detail.partition("(")[0]


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages."""
    return " / ".join(f"{load:.1f}" for load in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nodes", type=int, action="append", help="simulated node agents (a multiple of 250); repeat for several"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each steady window (issue 9: 60)")
    parser.add_argument(
        "--scenarios",
        type=scenario_list,
        default=SCENARIOS,
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all; steady includes the new incarnation and its restore)",
    )
    parser.add_argument("--log-dir", help="keep each scenario's coordinator log here (coordinator-N-SCENARIO.log)")
    args = parser.parse_args()
    if args.log_dir is not None and not os.path.isdir(args.log_dir):
        parser.error(f"--log-dir {args.log_dir}: not a directory")
    # Each process holds one end of every agent's connections: the soft limit up to the hard one
    # (inherited by the coordinator process).
    nodes = max(args.nodes or [1000])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections_per_agent(nodes) * nodes + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard)
        )
    gc.set_threshold(*GC_THRESHOLDS)  # the coordinator's (``run_coordinator``), for the same reason
    all_met = True
    results = {}
    for nodes in args.nodes or [1000]:
        print(f"N = {nodes:,}: load average {load_average()} at the start", flush=True)
        try:
            rows = asyncio.run(bench(nodes, args.seconds, args.scenarios, args.log_dir))
        except TimeoutError as err:  # the cluster never formed or settled: every goal at this N is missed
            rows = [("the cluster formed and settled", str(err), f"within {SCENARIO_TIMEOUT:g} s", False)]
        results[nodes] = rows
        print_rows(nodes, rows)
        print(f"N = {nodes:,}: load average {load_average()} at the end", flush=True)
        all_met &= all(met is not False for *_, met in rows)
    print(
        f"\ncoordinator scale: steady windows of {args.seconds:g} s; {os.cpu_count()} CPUs shared by the coordinator and the load "
        f"generator (one process, one event loop); load average {os.getloadavg()[0]:.1f}: {'every goal met' if all_met else 'goals MISSED'}"
    )
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
