"""The chaos suite (issue 10): one real Orbax job survives a seeded random sequence of faults.

    python -m tests.drivers.chaos [--seed N] [--faults K] [--variant dp2|dp1|xor|rs|grants|kube] [--only FAULT,...]

(Over 500 lines on purpose: one runnable tool whose faults, oracle and report read best together;
what it shares with the tests lives in ``tests/helpers``.)

A coordinator, four node agents (2 slices x 2 nodes, tmpfs, peer tier, backups) and ``examples/train.py`` training
without end. Each fault runs one cycle: the fault, a failure (every training process SIGKILLed), the pods recreated,
and the checks. ``dp2`` is data parallelism 2 (identical peers, nothing copied); ``dp1`` is data parallelism 1 with
``--replicas 2``; ``xor`` is data parallelism 1 with ``--redundancy xor:4`` (one parity group of the four ranks, no
full copies); ``rs`` the same with ``rs:4:2`` (two Reed-Solomon shards per stripe); ``grants`` is ``dp1`` with
``--peer-grants`` on the coordinator and the agents (every push and peer fetch on a signed grant); ``kube`` is
``grants`` with per-node identity, on a real control plane of its own (``tests/helpers/kube/kube_nodes.py``): the
coordinator runs ``--kube --node-identity``, each agent reports with the projected token of the agents' DaemonSet pod
on its Node (minted with ``TokenRequest``, rotated as the kubelet does), the job is a JobSet whose pods the JobSet
controller makes and the scheduler binds (``JobSetJob`` runs them on the agents), and a lost node's Node is deleted
and a fresh Node, its agent pod and token, registered. ``dp2``, ``dp1`` and ``xor`` back up to a ``file://``
directory; ``rs``, ``grants`` and ``kube`` to fake-gcs-server (``gs://``) behind a proxy that can answer 503
(``tests/helpers/store_proxy.py``).

What is right is decided here, from the tiers themselves, never from the coordinator: when the
training processes are dead and the fault has done its damage, the newest possible step is the
newest step of the current timeline that every rank can get a valid copy of (its own ramdisk, a
replica, its data-parallel peer's identical step, a rebuild from its parity group's own steps and shards, a
backup with ``COMMIT``), minus copies the suite corrupted. After every restart it checks that every rank restored exactly that step, that
backups and GC kept running (a new backup newer than the restored step is committed, then every node
deletes its copies older than that backup, but for the restored step), that each ramdisk stays below 90% full, that no agent or
coordinator exited or reports unhealthy, and, at the end, that every restored array is
bit-identical to an uninterrupted reference run of the same job.

Network faults cut one node's agent from the coordinator or from the other agents (iptables drops), or
put one node behind a lossy, delayed, rate-limited link; each node sits on this run's own loopback /24 and its
agent sends from its own address (``tests/helpers/network.py``), so the rules touch nothing else.

"Mid-push", "mid-upload", "mid-GC", "mid-stage", "mid-backup" and "mid-decode" kills are approximated by timing (a
random delay after the event that starts the work, the coordinator's pending backup, or the restore planned); a row
says when the work had visibly finished before the kill.

RPO (issue 49): at each failure, once one bound's time has passed since the fault's damage ended, the newest
``COMMIT``ted backup may be at most one backup interval (``BACKUP_EVERY`` steps) plus the steps of one upload
(``_UPLOAD_SECONDS`` at the job's median step time) behind the newest step every rank committed; a row over it is
wrong. Its ``rpo`` column is ``steps behind/bound``.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable

from examples.local_cluster import LocalCluster, LocalJob, NodeAgentProcess, unmount_all_below
from replicator.coordinator.planning import parity as parity_policy
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.parity_shards import ParityShards, ShardMeta
from replicator.wire import redundancy
from tests.helpers import network
from tests.helpers.backup_stores import FileStore, GcsStore
from tests.helpers.jobs import assert_same_state, by_event, recreate, replace_node
from tests.helpers.kube.jobset_job import JobSetJob
from tests.helpers.kube.kube_nodes import JOB_NAMESPACE, KubeNodes
from tests.helpers.polling import wait_until
from tests.helpers.ports import free_port, listen_address
from tests.helpers.steps import flip_byte
from tests.helpers.tools import find_tool

NODES, DP_PEER_OFFSET = 4, 2  # rank r's data-parallel peer in dp2 is r +- 2 (same worker, other slice)
SAVE_EVERY, BACKUP_EVERY = 3, 6
TRAIN = [
    "--steps",
    "100000",
    "--save-interval-steps",
    str(SAVE_EVERY),
    "--backup-interval-steps",
    str(BACKUP_EVERY),
    "--step-sleep",
    "0.2",
]
_DP1 = ("--data-parallelism", "1")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A variant's cluster: ``--replicas``, train.py flags, further ``mtc node`` flags, its backup store (``file``:
    a directory; ``gcs``: fake-gcs-server behind a proxy that can answer 503), whether the coordinator signs
    peer grants that the agents require (both ``--peer-grants``) and whether it runs on a real control plane with
    per-node identity (``kube``: the job a JobSet, each agent proving its Node)."""

    replicas: int
    train: tuple[str, ...] = ()
    agent_args: tuple[str, ...] = ()
    store: str = "file"
    peer_grants: bool = False
    kube: bool = False


VARIANTS = {
    "dp2": Variant(1),
    "dp1": Variant(2, _DP1),
    "xor": Variant(1, _DP1, ("--redundancy", "xor:4")),
    # One group of the four ranks with two Reed-Solomon shards per stripe: any two nodes of four may be lost.
    "rs": Variant(1, _DP1, ("--redundancy", "rs:4:2"), store="gcs"),
    # Replicas pushed and fetched on the coordinator's signed grants only (the cluster token alone reads nothing).
    "grants": Variant(2, _DP1, store="gcs", peer_grants=True),
    # ``grants`` with each grant tied to a Node proven by its agent's ServiceAccount token (a real API server).
    "kube": Variant(2, _DP1, store="gcs", peer_grants=True, kube=True),
}
ALL, REPLICATED, PARITY = tuple(VARIANTS), ("dp1", "grants", "kube"), ("xor", "rs")
_GC_SECONDS = 20.0  # a few report rounds
_RAMDISK_FULL = 0.9
_RESUME_TIMEOUT = (
    240.0  # seconds from recreation to the first step: beyond Orbax's 300 s marker wait is a failure anyway
)
_BACKUP_TIMEOUT = 120.0
_OUTAGE_SECONDS = {"file": 30.0, "gcs": 60.0}  # the directory gone; every request answered 503
# The RPO bound (issue 49): the newest COMMITted backup is at most one backup interval (BACKUP_EVERY steps) plus the
# steps trained during one upload behind the newest step every rank committed. One upload of this job (about 0.7 MiB
# for the four ranks) takes about a second on a quiet machine (the run prints it); _UPLOAD_SECONDS allows for 2 busy
# cores.
_UPLOAD_SECONDS = 10.0
# Partitions: past the coordinator's node timeout (4 s in LocalCluster), short of its holder grace (60 s).
_PARTITION_SECONDS = (6.0, 30.0)
_LOSS_PERCENT, _DELAY_MS, _SLOW_LINK_MBIT = 1.0, 50.0, 100.0
_HOSTS = 100  # loopback hosts whose agents send from their own address: 4 nodes and the fresh nodes of losses
_RAMDISK_SIZE = "256Mi"  # LocalJob's


@dataclasses.dataclass
class Row:
    """One restart: what was restored against what was possible."""

    fault: str
    restored: int | None = None
    possible: int | None = None
    seconds: float | None = None
    incarnation: int = 0
    rpo: tuple[int, int] | None = None  # (steps the newest backup was behind at the failure, the bound)
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def lost(self) -> int:
        """Steps lost beyond the minimum."""
        if self.possible is None or (self.restored is not None and self.restored >= self.possible):
            return 0
        return self.possible - (self.restored or 0)

    @property
    def right(self) -> bool:
        return not self.problems


class Chaos:
    """The cluster, the job, what the suite did to them, and the rows so far."""

    def __init__(self, workdir: str, variant: str, rng: random.Random, patient: bool = True):
        self.workdir, self.variant, self.rng, self.patient = workdir, variant, rng, patient
        setup = VARIANTS[variant]
        self.store = _open_store(setup.store, workdir)
        # Nodes 0-1 in rack-0, 2-3 in rack-1, as LocalCluster's blocks b0 and b1 without an API server.
        self.kube = KubeNodes(workdir, {f"node-{i}": _rack(i) for i in range(NODES)}) if setup.kube else None
        # Nodes on this run's own /24, each agent sending from its address: network faults touch this run only.
        self.cluster = LocalCluster(
            os.path.join(workdir, "cluster"),
            listen_address,
            replicas=setup.replicas,
            backup=self.store.url,
            env=self.store.env,
            agent_args=list(setup.agent_args),
            agent_wrapper=network.AS_HOST,
            subnet=network.run_subnet(),
            peer_grants=setup.peer_grants,
            kubeconfig=self.kube.kubeconfig if self.kube else None,
            node_identity=self.kube.namespace if self.kube else None,
            node_token=self.kube.token_file if self.kube else None,
        )
        self.network = contextlib.ExitStack()  # the loopback hosts' SNAT while the cluster runs
        self.job = self._new_job("chaos", workdir, [*TRAIN, *setup.train, "--dump-dir", ""])
        self.all_pods = []  # every pod of every incarnation, for its events
        self.incarnation: dict[str, int] = {}  # pod name -> its incarnation
        self.corrupt: set[tuple[int, int, str]] = set()  # (rank, step, holder) copies the suite damaged
        self.corrupt_shards: set[tuple[int, int]] = set()  # (step, stripe) parity shards the suite damaged
        self.owner_files: dict[tuple[int, int], dict] = {}  # (rank, step) -> the checksums its own node last held
        self.rollback: tuple[int, int, float] | None = (
            None  # (step, first incarnation of the new timeline, its start time)
        )
        self.forks: list[int] = []  # every rollback's step: backups are named by timeline (steps/<step>-t<n>)
        self.rows: list[Row] = []
        self.rpo: tuple[int, int] | None = None  # (steps behind, bound) at the last failure, for the next row
        self.commits_seen: dict[str, float] = {}  # every backup entry seen committed -> its COMMIT time
        self.calm_since = 0.0  # monotonic time the last fault's damage ended (or the job resumed)

    # -- the job -----------------------------------------------------------------------------

    def _new_job(self, name: str, workdir: str, train_args: list[str]) -> LocalJob:
        """Job ``name`` (agents set at start): with ``kube`` its JobSet is created, and its pods are the API
        server's."""
        port = free_port("0.0.0.0")
        if self.kube is None:
            return LocalJob(name, [], workdir, train_args, jax_port=port)
        self.kube.jobset(name, port, _RAMDISK_SIZE)
        return JobSetJob(
            name,
            [],
            workdir,
            train_args,
            size=_RAMDISK_SIZE,
            jax_port=port,
            client=self.kube.client,
            namespace=JOB_NAMESPACE,
        )

    def start(self) -> None:
        self.network.enter_context(network.loopback_hosts(f"{self.cluster.subnet}.{i}" for i in range(1, _HOSTS + 1)))
        self.cluster.start(NODES)
        self.job.agents = list(self.cluster.agents)
        self._start_pods()
        self.wait_saves(2)
        self.calm_since = time.monotonic()

    def _dump_dir(self, incarnation: int) -> str:
        return os.path.join(self.workdir, "dumps", f"i{incarnation}")

    def _start_pods(self) -> None:
        """Deletes the pods (if any) and starts the next incarnation, dumping its state to its own directory."""
        recreate(self.job, self._dump_dir(self.job.incarnations + 1))
        self.all_pods += self.job.pods
        self.incarnation |= {p.name: self.job.incarnations for p in self.job.pods}

    def saved(self, rank: int, pods=None) -> set[int]:
        """Steps ``rank`` committed in the current timeline (every incarnation; before a rollback, up to its step)."""
        step, first, _ = self.rollback or (0, 0, 0.0)
        return {
            e["step"]
            for p in pods or self.all_pods
            for e in by_event(p, "saved")
            if e["rank"] == rank and (self.incarnation[p.name] >= first or e["step"] <= step)
        }

    def newest_saved_by_all(self, pods=None) -> int:
        return max(set.intersection(*(self.saved(r, pods) for r in range(NODES))), default=0)

    def wait_saves(self, count: int, timeout: float = 180.0) -> int:
        """Waits until every rank of the current pods committed ``count`` more steps (after the newest
        they committed or restored); returns the newest."""
        restored = [e["step"] or 0 for p in self.job.pods for e in by_event(p, "restored")]
        target = max(self.newest_saved_by_all(self.job.pods), *restored, 0) + count * SAVE_EVERY
        self.job.wait(
            lambda: self.newest_saved_by_all(self.job.pods) >= target, timeout, f"step {target} saved by every rank"
        )
        return self.newest_saved_by_all(self.job.pods)

    def rank_of(self, agent: NodeAgentProcess) -> int | None:
        """The rank of the newest pod on ``agent`` that initialized."""
        for pod in reversed(self.all_pods):
            init = by_event(pod, "init") if pod.node is agent else []
            if init:
                return init[0]["rank"]
        return None

    def agent_of(self, rank: int) -> NodeAgentProcess:
        return next(a for a in self.job.agents if self.rank_of(a) == rank)

    def status(self) -> dict:
        jobs = self.cluster.coordinator.status(self.job.job)["jobs"]
        return jobs[0] if jobs else {}

    def backup_entry(self, step: int) -> str:
        """The store entry (``<step>[-t<t>]``, below the job's ``steps/``) of ``step``'s committed backup in the
        current timeline (see ``backups``)."""
        entries = [
            e for e in self.store.commits(self.job.job) if e.partition("-t")[0] == str(step) and self._in_lineage(e)
        ]
        return max(entries, key=lambda e: int(e.partition("-t")[2] or 0))

    def _in_lineage(self, entry: str) -> bool:
        """Timeline t > 0 (after the t-th rollback) is ``<step>-t<t>``; a timeline's steps after a
        later rollback's step were abandoned."""
        step, _, timeline = entry.partition("-t")
        later = self.forks[int(timeline or 0) :]
        return not later or int(step) <= min(later)

    def backups(self) -> dict[int, float]:
        """Steps of the current timeline with ``COMMIT`` in the store -> when it was written (read from
        the store, not the coordinator)."""
        commits = self.store.commits(self.job.job)
        self.commits_seen |= commits
        return {int(entry.partition("-t")[0]): at for entry, at in sorted(commits.items()) if self._in_lineage(entry)}

    def sample_rpo(self) -> None:
        """Takes the RPO sample for the next row: how many steps the newest COMMITted backup is behind the newest
        step every rank committed, against the bound (one backup interval plus the steps of one upload, at the
        job's step time). ``patient``: waits first until one bound's time has passed since the last fault's damage
        ended; otherwise the sample is taken at once (a stricter check: a backlog may not have caught up yet)."""
        step_seconds = self._step_seconds()
        bound = BACKUP_EVERY + math.ceil(_UPLOAD_SECONDS / step_seconds)
        if self.patient:
            time.sleep(max(0.0, self.calm_since + BACKUP_EVERY * step_seconds + _UPLOAD_SECONDS - time.monotonic()))
        newest = self.newest_saved_by_all(self.job.pods)
        self.rpo = (max(0, newest - max(self.backups(), default=0)), bound)

    def backup_delays(self) -> list[float]:
        """Seconds from each backup seen committed being trained (rank 0's last ``step`` event of its step before the
        ``COMMIT``) to its ``COMMIT``: what "one upload" is in the RPO bound, measured (retention deletes old ones:
        those the suite saw)."""
        trained: dict[int, list[float]] = {}
        for pod in self.all_pods:
            for e in by_event(pod, "step"):
                trained.setdefault(e["step"], []).append(e["time"])
        return [
            at - max(before)
            for entry, at in self.commits_seen.items()
            if (before := [t for t in trained.get(int(entry.partition("-t")[0]), []) if t <= at])
        ]

    def _step_seconds(self) -> float:
        """The median seconds per step of the current pods (rank 0's ``step`` events), 0.25 before any."""
        times = [e["time"] for p in self.job.pods for e in by_event(p, "step")]
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
        return statistics.median(gaps) if gaps else 0.25

    # -- the oracle --------------------------------------------------------------------------

    def _in_timeline(self, rank: int, step: int, written: float) -> bool:
        """Whether ``rank``'s copy of ``step``, written at ``written`` (unix seconds), is of the current
        timeline: older than the rollback, saved by its pods, or written after the rollback began (a
        step Orbax committed just before its process was killed has no ``saved`` event)."""
        return (
            self.rollback is None or step <= self.rollback[0] or step in self.saved(rank) or written >= self.rollback[2]
        )

    def copies(self) -> set[tuple[int, int, str]]:
        """Every valid (rank, step, holder) copy in the tiers now: committed local steps (with Orbax's
        commit evidence), replicas, complete backups; minus damaged and abandoned-timeline copies."""
        found: dict[tuple[int, int, str], float] = {}  # -> when it was written

        def written(path: str) -> float | None:
            with contextlib.suppress(FileNotFoundError):
                return os.path.getmtime(path)
            return None

        for agent in self.job.agents:
            rank, ramdisk = self.rank_of(agent), agent.ramdisk(self.job.job)
            client = os.path.join(ramdisk, "client")
            for n in os.listdir(client) if rank is not None and os.path.isdir(client) else []:
                if (
                    n.isascii()
                    and n.isdigit()
                    and (at := written(os.path.join(client, n, "_CHECKPOINT_METADATA"))) is not None
                ):
                    found[(rank, int(n), agent.node_id)] = at
            replicas = os.path.join(ramdisk, "mtc", "replicas")
            for rank_dir in os.listdir(replicas) if os.path.isdir(replicas) else []:
                for n in os.listdir(os.path.join(replicas, rank_dir)):
                    if n.endswith(".json") and (at := written(os.path.join(replicas, rank_dir, n))) is not None:
                        found[(int(rank_dir.split("-")[1]), int(n[:-5]), agent.node_id)] = at
        found |= {(rank, step, "backup"): at for step, at in self.backups().items() for rank in range(NODES)}
        valid = {c for c, at in found.items() if c not in self.corrupt and self._in_timeline(c[0], c[1], at)}
        return valid | self._decodable(valid)

    def _decodable(self, valid: set[tuple[int, int, str]]) -> set[tuple[int, int, str]]:
        """(rank, step, "parity") for each rank its group can rebuild: the other members' valid own steps and the
        valid shards leave every stripe it contributes to enough shards. A shard is valid when the suite did not
        damage it, it was built over the checksums the members' own nodes hold now (``redundancy.basis``), and it is
        of the current timeline."""
        files = self.owner_files  # as the coordinator, remembered past the loss of the owner's node
        own: set[tuple[int, int]] = set()  # (rank, step) whose own copy is valid
        shards: list[ShardMeta] = []
        for agent in self.job.agents:
            ramdisk = agent.ramdisk(self.job.job)
            if not os.path.isdir(os.path.join(ramdisk, "mtc")):
                continue
            for step, manifest in JobMeta(ramdisk).manifests().items():
                files[(manifest.rank, step)] = manifest.files  # a flipped byte leaves the owner's checksums
                if (manifest.rank, step, agent.node_id) in valid:
                    own.add((manifest.rank, step))
            held = ParityShards(ramdisk)
            shards += [m for m in held.held() if self._shard_in_timeline(held, m)]
        usable: dict[tuple[int, tuple[int, ...], int], set[tuple[int, int]]] = {}
        for shard in shards:
            digests = [files.get((r, shard.step)) for r in shard.members]
            if (shard.step, shard.stripe) in self.corrupt_shards or any(d is None for d in digests):
                continue
            if shard.basis == redundancy.basis(tuple(redundancy.files_digest(d) for d in digests if d is not None)):
                usable.setdefault((shard.step, shard.members, shard.parity), set()).add((shard.stripe, shard.index))
        rebuilt = set()
        for (step, members, parity), held in usable.items():
            for position, rank in enumerate(members):
                live = {p for p, r in enumerate(members) if p != position and (r, step) in own}
                if parity_policy._rebuildable(members, parity, position, live, held):
                    rebuilt.add((rank, step, "parity"))
        return rebuilt

    def _shard_in_timeline(self, held: ParityShards, shard: ShardMeta) -> bool:
        """Whether ``shard`` is of the current timeline: of a step before the rollback, or written after it began (with
        ``rs`` a stripe's shards alone rebuild its members, so an abandoned step's shards must not count)."""
        if self.rollback is None or shard.step <= self.rollback[0]:
            return True
        with contextlib.suppress(FileNotFoundError):
            return os.path.getmtime(held.path(shard.step, shard.members[0], shard.stripe)) >= self.rollback[2]
        return False

    def settled_possible(self, quiet: float = 2.0, timeout: float = 20.0) -> int | None:
        """``newest_possible`` once the tiers stop changing (``quiet`` s without a change, at most ``timeout`` s): after
        a failure without ``fail``'s settling, the encodes and pushes under way finish first, and the restore may use
        them."""
        last, since, deadline = None, time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            copies = self.copies()
            if copies != last:
                last, since = copies, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
            time.sleep(0.5)
        return self.newest_possible()

    def newest_possible(self) -> int | None:
        """The newest step every rank can restore a valid copy of, or None (a fresh start is right)."""
        copies = self.copies()
        available = {r: {s for rank, s, _ in copies if rank == r} for r in range(NODES)}
        if self.variant == "dp2":
            # A peer's copy of a step, its backup included, is this rank's data when both committed it: the planner
            # serves a rank from any copy of an identical peer (a flipped backup object of one rank's own files
            # leaves its peer's backup usable).
            for r in range(NODES):
                available[r] |= {s for rank, s, _ in copies if rank == (r + DP_PEER_OFFSET) % NODES} & self.saved(r)
        return max(set.intersection(*available.values()), default=None)

    # -- faults' building blocks -------------------------------------------------------------

    def fail(self, rpo: bool = True) -> None:
        """Every training process is SIGKILLed; waits (bounded) until the coordinator has seen the
        last commits and their replicas or identity, and the nodes deleted what that made safe to
        delete, so a fault right after (a node loss, a flipped byte) meets well defined tiers. The RPO sample
        (``sample_rpo``) is taken first, unless ``rpo`` is False (a fault still under way: the bound holds after it)."""
        if rpo:
            self.sample_rpo()
        self.job.kill_training()
        newest = self.newest_saved_by_all(self.job.pods)
        with contextlib.suppress(TimeoutError, OSError):
            wait_until(
                lambda: (
                    (s := self.status()).get("newest_complete_step") is not None
                    and s["newest_complete_step"] >= newest
                    and s["safe_step"] == s["newest_complete_step"]
                ),
                20,
                "settled",
            )
            status = self.status()
            safe, keep = (
                status.get("safe_step"),
                {status.get("backup_pending"), (status.get("restore") or {}).get("step")},
            )
            if safe is not None:
                wait_until(
                    lambda: not [c for c in self.copies() if c[2] != "backup" and c[1] < safe and c[1] not in keep],
                    10,
                    "GC of what the safe step allows",
                )

    def lose(self, rank: int) -> NodeAgentProcess:
        """The node holding ``rank`` is lost with its RAM; a fresh node takes its place (with ``kube``: a fresh Node
        in its rack, its agent started with its own token, and then the lost node's Node deleted, as the cloud's
        node controller does once the node is gone)."""
        lost = self.agent_of(rank)
        index = self.job.agents.index(lost)
        if self.kube:
            self.kube.join(f"node-{len(self.cluster.agents)}", _rack(index))
        self.job.agents[:] = replace_node(self.cluster, self.job, index)
        if self.kube:
            self.kube.lose(lost.node_id)
        return self.job.agents[index]

    def kill_agent(self, agent: NodeAgentProcess, down_seconds: float = 1.0) -> None:
        """SIGKILLs an agent (its ramdisks survive: tmpfs lives in the host) and restarts it."""
        agent.kill()
        time.sleep(down_seconds)
        agent.start()

    def freeze(self, agents: list[NodeAgentProcess], seconds: float) -> threading.Timer:
        """SIGSTOPs ``agents``; they are SIGCONTed after ``seconds`` by a timer (returned)."""
        for agent in agents:
            agent.pause()
        timer = threading.Timer(seconds, lambda: [a.resume() for a in agents])
        timer.start()
        return timer

    def restart(
        self, label: str, possible: int | None, during: Callable[[], None] | None = None, settle: bool = True
    ) -> Row:
        """Recreates the pods, runs ``during`` (a fault in the restore), waits for the first step,
        checks the restore and (``settle``) that backups and GC go on. The row is also returned."""
        row = Row(label, possible=possible, incarnation=self.job.incarnations + 1, rpo=self.rpo)
        self.rows.append(row)
        if self.rpo and self.rpo[0] > self.rpo[1]:
            row.problems.append(f"RPO: the newest backup {self.rpo[0]} steps behind, bound {self.rpo[1]}")
        self.rpo = None
        started, started_wall = time.monotonic(), time.time()
        self._start_pods()
        try:
            if during:
                during()
            self.job.wait(
                lambda: any(by_event(p, "step") for p in self.job.pods),
                _RESUME_TIMEOUT,
                "the first step after the restart",
            )
            row.seconds = time.monotonic() - started
            self.calm_since = time.monotonic()
            self.job.wait(lambda: all(by_event(p, "restored") for p in self.job.pods), 60, "every rank restored")
        except (TimeoutError, RuntimeError) as err:
            row.problems.append(f"no resume: {str(err).splitlines()[0][:160]}")
            return row
        restored = {by_event(p, "restored")[0]["step"] for p in self.job.pods}
        row.restored = max(restored, key=lambda s: s or 0)
        if len(restored) > 1:
            row.problems.append(f"ranks restored different steps {sorted(restored, key=lambda s: s or 0)}")
        if row.restored != possible:
            older = possible is not None and (row.restored or 0) < possible
            row.problems.append(
                f"restored {row.restored}, newest possible {possible}" + (" (unnecessary rollback)" if older else "")
            )
        if settle:
            self._check_backups_and_gc(row, row.restored or 0, started_wall)
        self._check_processes(row)
        return row

    def _check_backups_and_gc(self, row: Row, after: int, since: float) -> None:
        """A backup of a step after ``after`` is committed after time ``since``; then GC deletes, on
        every node, every copy older than that backup (it is safe), and each ramdisk stays below
        ``_RAMDISK_FULL`` of its size."""
        try:
            self.job.wait(
                lambda: any(s > after and t > since for s, t in self.backups().items()),
                _BACKUP_TIMEOUT,
                f"a new backup of a step after {after}",
            )
        except (TimeoutError, RuntimeError) as err:
            row.problems.append(f"backups stopped: {str(err).splitlines()[0][:120]}")
            return
        backed_up = max(self.backups())
        try:
            wait_until(
                lambda: not self._older_than(backed_up, row.restored),
                _GC_SECONDS,
                f"GC of steps before backup {backed_up}",
            )
        except TimeoutError:
            stale = self._older_than(backed_up, row.restored)
            row.problems.append(f"GC stopped: copies older than backup {backed_up} after {_GC_SECONDS:.0f} s: {stale}")
        for agent in self.job.agents:
            usage = os.statvfs(agent.ramdisk(self.job.job))
            if (usage.f_blocks - usage.f_bfree) > _RAMDISK_FULL * usage.f_blocks:
                row.problems.append(f"ramdisk of {agent.node_id} over {_RAMDISK_FULL:.0%} full")

    def _older_than(self, step: int, restored: int | None) -> list[tuple[int, int, str]]:
        """In-cluster copies older than ``step``, but for the restored step (kept as the restore's source)."""
        return sorted(c for c in self.copies() if c[2] != "backup" and c[1] < step and c[1] != restored)

    def _check_processes(self, row: Row) -> None:
        coordinator = self.cluster.coordinator
        named = [(a.node_id, a, None) for a in self.job.agents] + [
            ("coordinator", coordinator, coordinator.ssl_context())
        ]
        for name, process, context in named:
            if process.process.poll() is not None:
                row.problems.append(f"{name} exited {process.process.returncode}")
                continue
            try:
                with urllib.request.urlopen(process.url + "/healthz", timeout=10, context=context):
                    pass
            except OSError as err:
                row.problems.append(f"{name} unhealthy: {err}")

    def check_values(self) -> None:
        """Runs the uninterrupted reference to the newest restored step and compares every restore.
        No restore at all is a harness error on the last row: the sequence compared no value."""
        steps = [r.restored for r in self.rows if r.restored]
        if not steps:
            if self.rows:
                self.rows[-1].problems.append(
                    "harness error: no restart restored a step, no value compared with the reference"
                )
            return
        self.job.kill_training()
        reference = self._new_job(
            "reference",
            os.path.join(self.workdir, "reference"),
            [
                "--steps",
                str(max(steps)),
                "--save-interval-steps",
                str(SAVE_EVERY),
                "--backup-interval-steps",
                str(BACKUP_EVERY),
                "--dump-dir",
                os.path.join(self.workdir, "reference-dump"),
            ],
        )
        reference.agents = list(self.job.agents)
        reference.create_pods()
        reference.start_training()
        reference.wait_done(timeout=600)
        reference.delete_pods()
        for row in self.rows:
            if not row.restored:
                continue
            for rank in range(NODES):
                name = f"rank{rank}-step{row.restored}.npz"
                reference_dump = os.path.join(self.workdir, "reference-dump", name)
                try:
                    assert_same_state(os.path.join(self._dump_dir(row.incarnation), name), reference_dump)
                except (AssertionError, FileNotFoundError) as err:
                    row.problems.append(
                        f"rank {rank} values differ from the reference: {str(err).splitlines()[0][:120]}"
                    )
                    break

    def stop(self) -> None:
        try:
            self.job.kill_training()
            for agent in self.cluster.agents:
                agent.resume()
            self.cluster.stop()
            self.store.close()
            self.network.close()
        finally:
            if self.kube:  # a control plane left running would hold its ports and CPU
                self.kube.stop()
        unmount_all_below(self.workdir)  # the pods' bind mounts


def _rack(index: int) -> str:
    """The rack of node ``index`` of the job's four (a fresh node joins its predecessor's)."""
    return f"rack-{index // 2}"


def _open_store(kind: str, workdir: str) -> FileStore | GcsStore:
    """The run's backup store: a directory, or fake-gcs-server behind its 503 proxy (``.tools/bin``, ``make tools``).

    Raises:
      RuntimeError: fake-gcs-server is not installed.
    """
    if kind == "file":
        return FileStore(os.path.join(workdir, "object-store"))
    binary = find_tool("fake-gcs-server")
    if binary is None:
        raise RuntimeError("fake-gcs-server is neither on PATH nor in .tools/bin; run `make tools`")
    return GcsStore(binary, os.path.join(workdir, "gcs-data"))


# -- the faults: each runs one cycle on a training job and leaves it training ---------------------


def preemption(chaos: Chaos) -> None:
    chaos.fail()
    chaos.restart("preemption", chaos.newest_possible())


def coordinator_kill_mid_restore(chaos: Chaos) -> None:
    chaos.fail()
    delay = chaos.rng.uniform(0.2, 2.0)

    def kill():
        time.sleep(delay)
        _kill_coordinator(chaos)

    chaos.restart(f"coordinator SIGKILL {delay:.1f}s into restore", chaos.newest_possible(), kill)


def freeze_training(chaos: Chaos) -> None:
    seconds, agent = chaos.rng.uniform(5, 40), chaos.rng.choice(chaos.job.agents)
    chaos.freeze([agent], seconds).join()
    chaos.calm_since = time.monotonic()
    chaos.wait_saves(2)
    chaos.fail()
    chaos.restart(f"SIGSTOP {agent.node_id} {seconds:.0f}s in training", chaos.newest_possible())


def freeze_restore(chaos: Chaos) -> None:
    seconds, rank = chaos.rng.uniform(5, 40), chaos.rng.randrange(NODES)
    chaos.fail()
    agent = chaos.agent_of(rank)
    chaos.restart(
        f"SIGSTOP {agent.node_id} {seconds:.0f}s in restore",
        chaos.newest_possible(),
        lambda: chaos.freeze([agent], seconds),
    )


def holders_of(chaos: Chaos, rank: int, step: int | None) -> list[NodeAgentProcess]:
    """The other nodes holding ``rank``'s data: its data-parallel peer (dp2) or its replicas of ``step`` (dp1)."""
    if chaos.variant == "dp2":
        return [chaos.agent_of((rank + DP_PEER_OFFSET) % NODES)]
    nodes = {holder for r, s, holder in chaos.copies() if r == rank and s == step}
    return [a for a in chaos.job.agents if a.node_id in nodes and chaos.rank_of(a) != rank]


def freeze_other_holder(chaos: Chaos) -> None:
    seconds, rank = chaos.rng.uniform(5, 40), chaos.rng.randrange(NODES)
    chaos.fail()
    holders = holders_of(chaos, rank, chaos.newest_possible())
    chaos.lose(rank)
    chaos.restart(
        f"node loss, other holders {'+'.join(a.node_id for a in holders)} SIGSTOP {seconds:.0f}s",
        chaos.newest_possible(),
        lambda: chaos.freeze(holders, seconds),
    )


def _kill_after_save(chaos: Chaos, what: str, low: float, high: float) -> None:
    """SIGKILLs a random rank's agent ``low..high`` s after that rank commits its next step (the
    push or GC it starts is then likely under way), restarts it, then a preemption."""
    rank, delay = chaos.rng.randrange(NODES), chaos.rng.uniform(low, high)
    agent, before = chaos.agent_of(rank), chaos.saved(rank)
    chaos.job.wait(lambda: chaos.saved(rank) - before, 60, f"rank {rank} commits")
    time.sleep(delay)
    chaos.kill_agent(agent)
    chaos.calm_since = time.monotonic()
    chaos.wait_saves(2)
    chaos.fail()
    chaos.restart(f"SIGKILL {agent.node_id} ~{what} ({delay:.1f}s after commit)", chaos.newest_possible())


def kill_mid_push(chaos: Chaos) -> None:
    _kill_after_save(chaos, "mid-push", 0.1, 0.8)


def kill_mid_gc(chaos: Chaos) -> None:
    _kill_after_save(chaos, "mid-GC", 0.8, 2.5)


def kill_mid_upload(chaos: Chaos) -> None:
    wait_until(lambda: chaos.status().get("backup_pending") is not None, 90, "a backup under way")
    pending, agent = chaos.status()["backup_pending"], chaos.rng.choice(chaos.job.agents)
    chaos.kill_agent(agent)
    chaos.calm_since = time.monotonic()
    finished = pending in chaos.backups()
    chaos.wait_saves(2)
    chaos.fail()
    chaos.restart(
        f"SIGKILL {agent.node_id} mid-upload of {pending}{' (it had finished)' if finished else ''}",
        chaos.newest_possible(),
    )


def kill_mid_stage(chaos: Chaos) -> None:
    rank = chaos.rng.randrange(NODES)
    chaos.fail()
    agent = chaos.agent_of(rank)
    client = os.path.join(agent.ramdisk(chaos.job.job), "client")

    def kill():
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: any(n.startswith(".mtc-staged") or n.endswith(".restore") for n in os.listdir(client)),
                20,
                "staging",
            )
        chaos.kill_agent(agent)

    chaos.restart(f"SIGKILL {agent.node_id} mid-stage", chaos.newest_possible(), kill)


def node_loss(chaos: Chaos) -> None:
    rank = chaos.rng.randrange(NODES)
    chaos.fail()
    lost = chaos.agent_of(rank).node_id
    chaos.lose(rank)
    chaos.restart(f"node loss ({lost}, rank {rank})", chaos.newest_possible())


def flip_local(chaos: Chaos) -> None:
    chaos.fail()
    step, copies = chaos.newest_possible(), chaos.copies()  # the step a restore would take
    rank = chaos.rng.choice([r for r in range(NODES) if (r, step, chaos.agent_of(r).node_id) in copies])
    agent = chaos.agent_of(rank)
    flip_byte(os.path.realpath(os.path.join(agent.ramdisk(chaos.job.job), "client", str(step))))
    chaos.corrupt.add((rank, step, agent.node_id))
    chaos.restart(f"flipped byte in rank {rank}'s local step {step}", chaos.newest_possible())


def flip_replica(chaos: Chaos) -> None:
    """A byte flipped in another node's copy of a rank's newest step, then that rank's node is lost."""
    rank = chaos.rng.randrange(NODES)
    chaos.fail()
    step = chaos.newest_possible()  # the step a restore would take
    holder = holders_of(chaos, rank, step)[0]
    if chaos.variant == "dp2":  # the other copy is the peer's own step
        owner = chaos.rank_of(holder)
        flip_byte(os.path.realpath(os.path.join(holder.ramdisk(chaos.job.job), "client", str(step))))
    else:
        owner = rank
        flip_byte(os.path.join(holder.ramdisk(chaos.job.job), "mtc", "replicas", f"rank-{rank}", str(step)))
    chaos.corrupt.add((owner, step, holder.node_id))
    chaos.lose(rank)
    chaos.restart(
        f"flipped byte in {holder.node_id}'s copy of step {step}, rank {rank}'s node lost", chaos.newest_possible()
    )


def flip_parity(chaos: Chaos) -> None:
    """A byte flipped in a parity shard of the step a restore would take, then the node of a rank whose rebuild
    needs that shard is lost (xor: one group of the four ranks, stripe ``s``'s shard on rank ``s``'s node)."""
    rank = chaos.rng.randrange(NODES)
    chaos.fail()
    step = chaos.newest_possible()
    stripe = chaos.rng.choice([s for s in range(NODES) if s != rank])
    holder = chaos.agent_of(stripe)
    flip_byte(ParityShards(holder.ramdisk(chaos.job.job)).path(step, 0, stripe))
    chaos.corrupt_shards.add((step, stripe))
    chaos.lose(rank)
    chaos.restart(
        f"flipped byte in {holder.node_id}'s parity shard {stripe} of step {step}, rank {rank}'s node lost",
        chaos.newest_possible(),
    )


def flip_backup(chaos: Chaos) -> None:
    """A byte flipped in the newest backup of a rank, then that rank and every other in-cluster
    holder of its data are lost, so the backup tier must serve it."""
    rank = chaos.rng.randrange(NODES)
    chaos.fail()
    step = max(chaos.backups())
    entry, job = chaos.backup_entry(step), chaos.job.job
    manifests = [json.loads(chaos.store.read(job, f"{entry}/rank-{r}.manifest.json"))["files"] for r in range(NODES)]
    victim = max(manifests[rank].values(), key=lambda e: e["size"])["object"]
    chaos.store.flip(job, f"{entry}/{victim}")
    for r, files in enumerate(manifests):  # every rank whose manifest names the damaged object (deduplicated uploads)
        if any(e["object"] == victim for e in files.values()):
            chaos.corrupt.add((r, step, "backup"))
    lost = [chaos.agent_of(rank), *holders_of(chaos, rank, chaos.newest_possible())]
    for agent in lost:
        chaos.lose(chaos.rank_of(agent))
    chaos.restart(f"flipped byte in backup {step} of rank {rank}, {len(lost)} nodes lost", chaos.newest_possible())


def store_outage(chaos: Chaos) -> None:
    """The store is unavailable for ``_OUTAGE_SECONDS`` while the job saves (``file``: its directory moved away and a
    file put in its place, so nothing can recreate it; ``gcs``: every request answered 503); then it is back, and
    backups must catch up within the RPO bound."""
    seconds = _OUTAGE_SECONDS[chaos.store.kind]
    with chaos.store.gone():
        time.sleep(seconds)
    chaos.calm_since = time.monotonic()
    chaos.wait_saves(1)
    chaos.fail()
    chaos.restart(chaos.store.outage(seconds), chaos.newest_possible())


def _kill_coordinator(chaos: Chaos) -> None:
    chaos.cluster.coordinator.kill()
    time.sleep(2)
    chaos.cluster.coordinator.start()


def _backup_under_way(chaos: Chaos) -> int:
    """Waits for the coordinator's pending backup, then a random 0-0.3 s into its upload (one takes about a second
    here); returns its step."""
    wait_until(lambda: chaos.status().get("backup_pending") is not None, 90, "a backup under way", interval=0.05)
    pending = chaos.status()["backup_pending"]
    time.sleep(chaos.rng.uniform(0.0, 0.3))
    return pending


def coordinator_kill_mid_backup(chaos: Chaos) -> None:
    """The coordinator is SIGKILLed (and restarted) while it has a backup pending and its ranks upload; the job
    trains on, and the backups must catch up within the RPO bound before the failure."""
    pending = _backup_under_way(chaos)
    finished = pending in chaos.backups()
    _kill_coordinator(chaos)
    chaos.calm_since = time.monotonic()
    chaos.wait_saves(2)
    chaos.fail()
    label = f"coordinator SIGKILL mid-backup of {pending}{' (it had finished)' if finished else ''}"
    chaos.restart(label, chaos.newest_possible())


def coordinator_kill_mid_decode(chaos: Chaos) -> None:
    """A rank's node is lost (its step is rebuilt from its parity group), and the coordinator is SIGKILLed and
    restarted a random 0-1.5 s after the restore is planned, while the fresh node decodes."""
    rank, delay = chaos.rng.randrange(NODES), chaos.rng.uniform(0.0, 1.5)
    chaos.fail()
    lost = chaos.agent_of(rank).node_id
    chaos.lose(rank)
    before: dict = {}

    def kill():
        with contextlib.suppress(TimeoutError, OSError):
            wait_until(lambda: (chaos.status().get("restore") or {}).get("step") is not None, 30, "a restore planned")
        time.sleep(delay)
        with contextlib.suppress(OSError):
            before.update(chaos.status().get("restore") or {})
        _kill_coordinator(chaos)

    row = chaos.restart(
        f"{lost} lost (rank {rank}), coordinator SIGKILL {delay:.1f}s into decode",
        chaos.newest_possible(),
        kill,
    )
    source = (before.get("sources") or {}).get(str(rank))
    if source:
        row.fault += f" ({source.partition(':')[0]} done before)"


def node_loss_mid_backup(chaos: Chaos) -> None:
    """A node is lost (and with it the job) while the coordinator's pending backup uploads, a node whose rank has
    not uploaded its manifest yet if any; after the restart, a preemption once one bound's time passed: the backup
    interrupted by the loss must not hold the next ones back."""
    chaos.sample_rpo()
    pending = _backup_under_way(chaos)
    entry = f"{pending}-t{len(chaos.forks)}" if chaos.forks else str(pending)
    uploading = [r for r in range(NODES) if not chaos.store.exists(chaos.job.job, f"{entry}/rank-{r}.manifest.json")]
    rank = chaos.rng.choice(uploading or range(NODES))
    finished = " (it had finished)" if pending in chaos.backups() else "" if uploading else " (every rank uploaded)"
    chaos.job.kill_training()
    lost = chaos.agent_of(rank).node_id
    chaos.copies()  # reads the owners' checksums while the node is there (the coordinator has them too)
    chaos.lose(rank)
    chaos.restart(f"{lost} lost (rank {rank}) mid-backup of {pending}{finished}", chaos.settled_possible())
    chaos.wait_saves(1)
    chaos.fail()
    chaos.restart(f"preemption after node loss mid-backup of {pending}", chaos.newest_possible())


def _cut(chaos: Chaos, what: str, side: list[str], others: list[str]) -> None:
    """Cuts ``side`` from ``others`` for a random time past the coordinator's node timeout while the job
    saves. Half of the cycles heal it, then a failure; the other half fail while it is on, so the restart
    begins cut off and heals whenever the time is up (it may be in the restore)."""
    seconds, during_failure = chaos.rng.uniform(*_PARTITION_SECONDS), chaos.rng.random() < 0.5
    fail_at = chaos.rng.uniform(3.0, seconds - 2.0) if during_failure else seconds
    installed = threading.Event()

    def hold():
        with network.partition(side, others):
            installed.set()
            time.sleep(seconds)

    cut = threading.Thread(target=hold, name="partition")
    cut.start()
    try:
        if not installed.wait(30):
            raise RuntimeError("the partition's rules were not installed")
        time.sleep(fail_at)
        if not during_failure:
            cut.join()
            chaos.calm_since = time.monotonic()
            chaos.wait_saves(2)
        chaos.fail(rpo=not during_failure)
        label = f"{what} {seconds:.0f}s" + (f", failure {fail_at:.0f}s in" if during_failure else ", healed, failure")
        chaos.restart(label, chaos.newest_possible())
    finally:
        cut.join()


def partition_from_coordinator(chaos: Chaos) -> None:
    """One node's agent cannot reach the coordinator (nor it the agent); the nodes still reach each other."""
    agent = chaos.rng.choice(chaos.job.agents)
    _cut(chaos, f"{agent.node_id} cut from the coordinator", [agent.listen], [chaos.cluster.coordinator.listen])


def partition_from_peers(chaos: Chaos) -> None:
    """One node's agent cannot reach the other agents (nor they it): in dp1 its pushes, and the pushes to it, fail.
    The coordinator reaches every node."""
    agent = chaos.rng.choice(chaos.job.agents)
    _cut(
        chaos,
        f"{agent.node_id} cut from its peers",
        [agent.listen],
        [a.listen for a in chaos.job.agents if a is not agent],
    )


def lossy_slow_link(chaos: Chaos) -> None:
    """Every packet from or to one node (its agent and its pod) crosses a lossy, slow link, and each TCP
    connection from or to it waits ``_DELAY_MS`` each way, through a few saves, the failure, the restore
    and the checks after it. Its open connections are reset as the delay begins (they reconnect through
    it), but the training processes' JAX connections, which stay undelayed until the failure."""
    agent = chaos.rng.choice(chaos.job.agents)
    host = agent.listen.rpartition(":")[0]
    with (
        network.delayed([host], _DELAY_MS, keep_open=[chaos.job.jax_port]),
        network.lossy([host], _LOSS_PERCENT),
        network.rate_limited([host], _SLOW_LINK_MBIT),
    ):
        chaos.wait_saves(2)
        chaos.fail()
        label = f"{agent.node_id} link {_LOSS_PERCENT:g}% loss, {_DELAY_MS:g} ms delay, {_SLOW_LINK_MBIT:g} Mbit/s"
        chaos.restart(label, chaos.newest_possible())


def _rollback(chaos: Chaos, pods_gone: bool) -> None:
    """``mtc restore-from`` the second newest backup (with the pods gone, or still published), then a
    preemption on the new timeline before it passes the abandoned one."""
    chaos.job.wait(lambda: len(chaos.backups()) >= 2, _BACKUP_TIMEOUT, "two backups")
    chaos.fail()
    if pods_gone:
        chaos.job.delete_pods()
    # Older than the newest (the oldest may be going to retention), and not one the suite damaged: an operator
    # rolls back to a step that restores (a damaged one is refused, or dropped at planning: docs/faults.md).
    intact = [s for s in sorted(chaos.backups()) if not any((r, s, "backup") in chaos.corrupt for r in range(NODES))]
    step = intact[-2] if len(intact) >= 2 else sorted(chaos.backups())[-2]
    command = [
        sys.executable,
        "-m",
        "replicator.cli",
        "restore-from",
        "--coordinator",
        chaos.cluster.coordinator.url,
        "--ca",
        chaos.cluster.coordinator.ca_file,
        "--token-file",
        chaos.cluster.token_file,
        "--job",
        f"default/{chaos.job.job}",
        "--step",
        str(step),
        "--yes",
    ]
    answer = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    chaos.rollback = (step, chaos.job.incarnations + 1, time.time())  # the abandoned timeline's pods are dead
    if not answer.returncode:
        chaos.forks.append(step)
    # The failure comes at the new timeline's first save, before it passes the abandoned one.
    # The rollback's step; the newest restorable step before it if a fault damaged the step's last copy.
    row = chaos.restart(f"rollback to {step}{' (no pods)' if pods_gone else ''}", chaos.newest_possible(), settle=False)
    if answer.returncode:
        row.problems.insert(0, f"restore-from refused: {answer.stderr.strip()[:120]}")
    chaos.wait_saves(1)
    chaos.fail()
    chaos.restart(f"preemption after rollback to {step}", chaos.newest_possible())


def rollback(chaos: Chaos) -> None:
    _rollback(chaos, pods_gone=False)


def rollback_no_pods(chaos: Chaos) -> None:
    _rollback(chaos, pods_gone=True)


FAULTS: dict[str, tuple[Callable[[Chaos], None], tuple[str, ...]]] = {
    "preemption": (preemption, ALL),
    "coordinator_kill_mid_restore": (coordinator_kill_mid_restore, ALL),
    "coordinator_kill_mid_backup": (coordinator_kill_mid_backup, ALL),
    "coordinator_kill_mid_decode": (coordinator_kill_mid_decode, PARITY),
    "freeze_training": (freeze_training, ALL),
    "freeze_restore": (freeze_restore, ALL),
    "freeze_other_holder": (freeze_other_holder, ("dp2", *REPLICATED)),
    "kill_mid_push": (kill_mid_push, REPLICATED),
    "kill_mid_stage": (kill_mid_stage, ALL),
    "kill_mid_upload": (kill_mid_upload, ALL),
    "kill_mid_gc": (kill_mid_gc, ALL),
    "node_loss": (node_loss, ALL),
    "node_loss_mid_backup": (node_loss_mid_backup, ALL),
    "flip_local": (flip_local, ALL),
    "flip_replica": (flip_replica, ("dp2", *REPLICATED)),
    "flip_backup": (flip_backup, ALL),
    "store_outage": (store_outage, ("dp2", "dp1", "xor")),  # the file store's directory gone
    "store_503": (store_outage, ("rs", "grants", "kube")),  # the fake-gcs store's proxy answering 503
    "partition_from_coordinator": (partition_from_coordinator, ALL),
    "partition_from_peers": (partition_from_peers, ALL),
    "lossy_slow_link": (lossy_slow_link, ALL),
    "rollback": (rollback, ALL),
    "rollback_no_pods": (rollback_no_pods, ALL),
    "flip_parity": (flip_parity, ("xor",)),
}


def draw(rng: random.Random, count: int, variant: str, allowed: list[str]) -> list[str]:
    """``count`` faults for ``variant``: every allowed fault once in a random order while the
    sequence is long enough, the rest drawn at random."""
    pool = [f for f in allowed if variant in FAULTS[f][1]]
    rng.shuffle(pool)
    return (
        (pool * (count // len(pool) + 1))[:count]
        if count <= len(pool)
        else pool + [rng.choice(pool) for _ in range(count - len(pool))]
    )


def render(rows: list[Row]) -> str:
    lines = [f"{'fault':<72}{'restored':>9}{'possible':>9}{'lost':>6}{'resume s':>10}{'rpo':>8}  result"]
    for r in rows:
        seconds = f"{r.seconds:.1f}" if r.seconds is not None else "-"
        rpo = f"{r.rpo[0]}/{r.rpo[1]}" if r.rpo else "-"
        lines.append(
            f"{r.fault[:71]:<72}{str(r.restored):>9}{str(r.possible):>9}{r.lost:>6}{seconds:>10}{rpo:>8}  "
            f"{'right' if r.right else 'WRONG: ' + '; '.join(r.problems)}"
        )
    return "\n".join(lines)


def summary(rows: list[Row], faults: int | None = None) -> str:
    """The run's totals; ``rpo`` columns are (steps the newest COMMITted backup was behind the newest step every
    rank committed, at the failure) / (the bound: one backup interval plus one upload's steps)."""
    wrong = [r for r in rows if not r.right]
    rollbacks = [r for r in rows if r.possible is not None and r.restored is not None and r.restored < r.possible]
    fresh = [r for r in rows if r.possible is not None and r.restored is None]
    seconds = [r.seconds for r in rows if r.seconds is not None]
    resume = f"{statistics.median(seconds):.1f} / {max(seconds):.1f}" if seconds else "-"
    sampled = [r.rpo for r in rows if r.rpo]
    worst = max(sampled, default=None)
    over = sum(lag > bound for lag, bound in sampled)
    return (
        (f"faults: {faults}, " if faults is not None else "")
        + f"restarts: {len(rows)}, right: {len(rows) - len(wrong)}, wrong: {len(wrong)}, "
        f"unnecessary rollbacks: {len(rollbacks)}, fresh starts with a complete step: {len(fresh)}, "
        f"steps lost beyond the minimum: {sum(r.lost for r in rows)}, "
        f"worst RPO: {f'{worst[0]} steps behind (bound {worst[1]})' if worst else '-'}, over the bound: {over} of "
        f"{len(sampled)}, median / max seconds to resume: {resume} (goal: 0 wrong, 0 unnecessary rollbacks)"
    )


def run(seed: int, faults: int, variant: str, allowed: list[str], workdir: str, patient: bool = True) -> list[Row]:
    """Runs ``faults`` faults drawn with ``seed``; returns the rows (values checked against the reference).
    ``patient``: see ``Chaos.sample_rpo``."""
    rng = random.Random(seed)
    sequence = draw(rng, faults, variant, allowed)
    print(f"chaos: seed {seed}, variant {variant}, {faults} faults: {', '.join(sequence)}", flush=True)
    chaos = Chaos(workdir, variant, rng, patient)
    try:
        started = time.monotonic()
        chaos.start()
        print(f"cluster and job up in {time.monotonic() - started:.0f} s", flush=True)
        for name in sequence:
            cycle, first_row = time.monotonic(), len(chaos.rows)
            try:
                FAULTS[name][0](chaos)
            except (
                TimeoutError,
                RuntimeError,
                OSError,
                ValueError,
                subprocess.CalledProcessError,
            ) as err:  # the fault itself could not be set up
                chaos.rows.append(Row(name, problems=[f"cycle failed: {str(err).splitlines()[0][:160]}"]))
            for line in render(chaos.rows[first_row:]).splitlines()[1:]:
                print(f"[{time.monotonic() - cycle:4.0f} s] {line}", flush=True)
            if chaos.rows[-1].seconds is None and any(
                p.process and p.process.poll() not in (None, 0) for p in chaos.job.pods
            ):
                print("the job is down and did not come back; stopping the sequence", flush=True)
                break
        if chaos.kube:
            print(f"agents' node tokens rotated (minted again at 80% of their lifetime): {chaos.kube.rotations}")
        delays = chaos.backup_delays()
        if delays:
            print(
                f"backups: {len(delays)} committed, seconds from the step to its COMMIT: median "
                f"{statistics.median(delays):.1f}, max {max(delays):.1f}",
                flush=True,
            )
        started = time.monotonic()
        chaos.check_values()
        print(f"reference run and comparison: {time.monotonic() - started:.0f} s", flush=True)
        return chaos.rows
    finally:
        chaos.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed")
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="dp2")
    parser.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults to draw from")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, dumps)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    allowed = args.only.split(",")
    unknown = set(allowed) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    workdir = tempfile.mkdtemp(prefix="mtc-chaos-")
    try:
        rows = run(seed, args.faults, args.variant, allowed, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work directory kept: {workdir}")
    print(render(rows))
    print(summary(rows, args.faults))
    print(
        f"replay: python -m tests.drivers.chaos --seed {seed} --faults {args.faults} --variant {args.variant}"
        + (f" --only {args.only}" if args.only != ",".join(FAULTS) else "")
    )
    return 0 if rows and all(r.right for r in rows) else 1  # no row: nothing was checked


if __name__ == "__main__":
    sys.exit(main())
