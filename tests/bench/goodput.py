"""Goodput under failures: one real JAX job, one seeded failure schedule, three checkpointing setups, two regimes.

    python -m tests.bench.goodput [--seed N] [--failures K] [--gap-seconds S] [--setups persistent,emergency,ours]
                                  [--regimes realistic,loopback] [--gpu-results FILE]
                                  [--save-runs FILE] [--from-runs FILE]  # keep the events; report kept ones again

The job is ``examples/train.py``'s (4 JAX processes, 2 slices x 2, BALLAST_MIB MiB per process, the same across
slices: a data-parallel state), trained without end and checkpointed three ways:

1. ``persistent``: Orbax's ordinary ``CheckpointManager`` (async saves) to the object store
   (``tests/bench/orbax_job.py``).
2. ``emergency``: ``orbax.checkpoint.experimental.emergency`` ``CheckpointManager``: local saves to a tmpfs per
   node, persistent saves to the object store.
3. ``ours``: the node agents and coordinator (``examples/local_cluster.py``; tmpfs ramdisks, peer tier, backups to
   the object store) under ``ReplicatorCheckpointManager``, async local saves (``--async-save``).

(The PyTorch job with NVRx local checkpointing beside ours is the ``torch_vs_nvrx`` bench.)

The object store is a real fake-gcs-server (GCS's JSON API, objects on the local disk), one bucket, a prefix per
setup and phase, reached by each node through a fake-gcs-server of its own on the same directory (its "front":
``goodput_regime.StoreFronts``). Orbax reaches it as ``gs://`` through tensorstore's GCS driver
(``TENSORSTORE_GCS_HTTP_URL``) and etils' epath through gcsfs (``STORAGE_EMULATOR_HOST``); our agents through
google-cloud-storage. Our agents run as loopback hosts of their own (``tests/helpers/network.py``): what one sends
leaves from its node's address.

The regimes (``tests/bench/goodput_regime.py``), each a complete run of every setup, realistic first:
- ``realistic``: each node's traffic to and from the object store passes a link of its own at the model's STORE_BW
  per host scaled to the bench's bytes per node (a full save or restore takes as long as 26.25 GB at 1.25 GB/s:
  21 s), and what a node sends its peers a link at NEAR_BW scaled the same way. JAX's own collectives (the
  accelerators' interconnect in production) are not limited.
- ``loopback``: the same, unlimited: the store as fast as RAM.

Each setup saves at its own interval (``goodput_model.save_interval_steps``): Young/Daly's from its blocking per
save, measured first in a calibration run of each setup (CALIBRATE_SECONDS of training, a save every
CALIBRATE_EVERY steps, on loopback), for a failure every (mean gap) seconds of training; the intervals of a tier that
uploads (persistent only's saves, emergency's persistent saves, ours' backups) no shorter than the regime's time for
the busiest node to upload one save (the bytes it uploaded per save in the calibration, at the regime's store link).

The failure schedule (``schedule``): a preemption, a node loss, then preemptions, each GAP seconds of training
after the first step of the incarnation before it (the later gaps seeded within +-25 %). A failure SIGKILLs every
training process; a preemption keeps the nodes (and their tmpfs), a node loss also loses node 3's RAM: its
tmpfs is emptied (ours: the agent dies with its ramdisk and a fresh node, already up, takes its place: a new node's
boot is counted for no setup). The job is then started again.
A setup whose job logs no step within RESTART_TIMEOUT seconds of a restart, or whose process exits with an
error, stops there; its row says so with the error.

Printed per regime and setup, from rank 0's step events: goodput = steps kept x ideal step time / wall time (from
the job's first start, with the object store and ours' coordinator and agents already up, as a cluster's are; the
ideal is the median step time of steps after which nothing was saved, over the regime's setups); the intervals;
steps lost per failure; seconds from each failure to the first step after it; training time blocked per save (the
step after a save, minus the ideal). Beside each row, the model (``tests/bench/goodput_model.py``, Young 1974 /
Daly 2006) at the seed's 70B model on 32 hosts (TARGET_BYTES per host) and a failure every MTBF_S seconds: the
measured blocking plus the bytes copied out of accelerator memory, the measured restarts plus the bytes copied back
in (``--gpu-results``: torch_gpu's measured rates, by default one H200's run in docs/results; else the stated assumption, printed) and, on loopback, the tier's
read at the stated bandwidth the measurement lacked. Run as root (tmpfs, tc): ``python -m tests.bench.goodput``.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, LocalJob, can_mount_tmpfs, scratch_dir, unmount_all_below
from tests.bench import goodput_model
from tests.bench.goodput_model import MTBF_S, NEAR_BW, STORE_BW, TARGET_BYTES
from tests.bench.goodput_regime import LOOPBACK, Regime, StoreFronts
from tests.helpers import network
from tests.helpers.jobs import replace_node
from tests.helpers.ports import free_port, listen_address
from tests.helpers.tools import require_tool

NODES, SLICES, LOST_NODE = 4, 2, 3
BALLAST_MIB = 64
NODE_BYTES = BALLAST_MIB * 2**20  # checkpoint bytes per node (the model's "per host")
STEP_SLEEP = 0.2
CALIBRATE_EVERY, CALIBRATE_SECONDS = 5, 15.0
RESTART_TIMEOUT = 150.0
STALL_S = 10.0  # no step for this long before a failure: the job had stopped training (the row says so)
SETUPS = ("persistent", "emergency", "ours")
REGIMES = ("realistic", "loopback")
BUCKET = "goodput"
GOAL = 0.95
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORBAX_JOB = os.path.join(ROOT, "tests", "bench", "orbax_job.py")


def schedule(seed: int, failures: int, gap: float) -> list[tuple[str, float]]:
    """[(kind, seconds of training before it)]: a preemption, a node loss, then preemptions (seeded gaps).

    Raises:
      ValueError: fewer than 2 failures.
    """
    if failures < 2:
        raise ValueError(f"the schedule needs at least a preemption and a node loss, got {failures} failures")
    rng = random.Random(seed)
    kinds = ["preemption", "node loss", *["preemption"] * (failures - 2)]
    return [(kind, gap if i < 2 else round(rng.uniform(0.75 * gap, 1.25 * gap), 1)) for i, kind in enumerate(kinds)]


@dataclasses.dataclass(frozen=True)
class Intervals:
    """A setup's save intervals, in steps.

    Attributes:
      save: between the saves that block training (persistent only: its saves to the store; the others: local).
      store: between the saves that reach the object store (persistent only: ``save``; emergency: its persistent
        saves; ours: the agents' backups).
      why: how they were chosen, for the output.
      upload: the busiest node's upload of one save at the regime's store link, in fast steps: the RPO bound is
        ``store + upload`` steps (``lag_verdict``).
    """

    save: int
    store: int
    why: str = ""
    upload: int = 0


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What each setup's calibration run measured.

    Attributes:
      step: the ideal step, seconds (the median step without a save, over the calibration runs).
      blocking: setup -> training seconds blocked per save (median).
      upload_bytes: setup -> the bytes the busiest node uploaded to the object store for one save.
      upload_seconds: setup -> how long one upload took, unlimited (``upload_span``).
      fast_step: a fast step, seconds (the tenth percentile of those steps): an upload bound in steps holds even
        when training runs faster than the median.
    """

    step: float
    blocking: dict[str, float]
    upload_bytes: dict[str, int]
    upload_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    fast_step: float = 0.0


def intervals_for(name: str, calibration: Calibration, regime: Regime, mtbf: float) -> Intervals:
    """``name``'s intervals in ``regime`` for a failure every ``mtbf`` seconds of training: Young/Daly's from its
    calibrated blocking; a tier that uploads, no shorter than its upload: the calibration's, or its busiest node's
    bytes at the regime's store link if longer, in fast steps (``Calibration.fast_step``)."""
    blocking, step = calibration.blocking[name], calibration.step
    measured = calibration.upload_seconds.get(name, 0.0)
    upload_s = max(measured, regime.upload_seconds(calibration.upload_bytes[name]))
    local = goodput_model.save_interval_steps(blocking, mtbf, step)
    upload = math.ceil(upload_s / (calibration.fast_step or step))
    store = max(local, upload)
    why = (
        f"Young/Daly {goodput_model.young_daly_interval(blocking, mtbf):.1f} s (δ {blocking:.3f} s, a failure every "
        f"{mtbf:.0f} s) = {local} steps of {step:.3f} s; upload {calibration.upload_bytes[name] / 2**20:.0f} MiB "
        f"{'at the link' if upload_s > measured else 'as calibrated'} {upload_s:.1f} s = "
        f"{upload} steps of {calibration.fast_step or step:.3f} s"
    )
    return Intervals(store if name == "persistent" else local, store, why, upload)


@dataclasses.dataclass
class Incarnation:
    """One start of the job: what rank 0 logged, and how it ended."""

    restored: int | None = None
    steps: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> unix time logged
    saves: set[int] = dataclasses.field(default_factory=set)
    killed_at: float | None = None


class OrbaxOnly:
    """The job under ``tests/bench/orbax_job.py`` (``mode``: persistent or emergency): 4 plain processes, no agents,
    process ``i`` reaching the object store through node ``i``'s store front.

    Args:
      prefix: the setup's objects in the bucket (its persistent directory).
    """

    def __init__(self, mode: str, workdir: str, stores: StoreFronts, prefix: str, intervals: Intervals):
        self.mode, self.workdir, self.stores, self.intervals = mode, workdir, stores, intervals
        self.persistent = f"gs://{BUCKET}/{prefix}"
        # Orbax's emergency manager wants its persistent directory to exist: on a bucket, a prefix holding an object.
        stores.admin.client().bucket(BUCKET).blob(f"{prefix}/.created").upload_from_string(b"")
        self.processes: list[subprocess.Popen] = []
        self.incarnations = 0
        for node in range(NODES):
            self._fresh_ramdisk(node)

    def _ramdisk(self, node: int) -> str:
        return os.path.join(self.workdir, f"node-{node}", "ramdisk")

    def _fresh_ramdisk(self, node: int) -> None:
        """An empty tmpfs for ``node`` (a plain directory when not root)."""
        path = self._ramdisk(node)
        unmount_all_below(path)
        subprocess.run(["rm", "-rf", "--one-file-system", path], check=True)
        os.makedirs(path)
        if can_mount_tmpfs():
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", path], check=True)

    def _log(self, rank: int) -> str:
        return os.path.join(self.workdir, "logs", f"i{self.incarnations}-rank{rank}")

    def start(self) -> None:
        self.incarnations += 1
        os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
        port = free_port("127.0.0.1")
        self.processes = []
        for rank in range(NODES):
            url = self.stores.url(rank)
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "TENSORSTORE_GCS_HTTP_URL": url, "STORAGE_EMULATOR_HOST": url}
            command = [
                sys.executable,
                ORBAX_JOB,
                "--mode",
                self.mode,
                "--process-id",
                str(rank),
                "--nodes",
                str(NODES),
                "--num-slices",
                str(SLICES),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--local-dir",
                self._ramdisk(rank),
                "--persistent-dir",
                self.persistent,
                "--steps",
                "1000000",
                "--save-interval-steps",
                str(self.intervals.save),
                "--persistent-interval-steps",
                str(self.intervals.store),
                "--ballast-mib",
                str(BALLAST_MIB),
                "--step-sleep",
                str(STEP_SLEEP),
            ]
            with open(self._log(rank) + ".jsonl", "wb") as out, open(self._log(rank) + ".stderr", "wb") as err:
                self.processes.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=ROOT))

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()

    def restart(self, kind: str) -> None:
        if kind == "node loss":
            self._fresh_ramdisk(LOST_NODE)
        self.start()

    def events(self) -> list[dict]:
        return read_events(self._log(0) + ".jsonl")

    def error(self) -> str | None:
        """The first error line of a process that exited with an error, if any."""
        for rank, process in enumerate(self.processes):
            if process.poll() not in (None, 0):
                return first_error(self._log(rank) + ".stderr") or f"rank {rank} exited {process.returncode}"
        return None

    def last_error(self) -> str | None:
        """The first error line any process of this incarnation printed (for a stall)."""
        return next(filter(None, (first_error(self._log(r) + ".stderr") for r in range(NODES))), None)

    def stop(self) -> None:
        """Kills the job and frees its tmpfs."""
        self.kill()
        unmount_all_below(self.workdir)


class Ours:
    """The job under our agents: ``examples/train.py`` on a ``LocalCluster`` on ``subnet`` (node ``i``'s agent runs as
    loopback host ``<subnet>.<i+1>`` and backs up through node ``i``'s store front; the spare node is node NODES),
    backups under ``prefix``."""

    def __init__(self, workdir: str, stores: StoreFronts, prefix: str, intervals: Intervals, subnet: str):
        self.stores = stores
        self.cluster = LocalCluster(
            os.path.join(workdir, "cluster"),
            listen_address,
            replicas=1,
            backup=f"gs://{BUCKET}/{prefix}",
            agent_wrapper=network.AS_HOST,
            subnet=subnet,
        )
        args = [
            "--steps",
            "1000000",
            "--save-interval-steps",
            str(intervals.save),
            "--backup-interval-steps",
            str(intervals.store),
            "--ballast-mib",
            str(BALLAST_MIB),
            "--ballast-layout",
            "data-parallel",
            "--async-save",
            "--step-sleep",
            str(STEP_SLEEP),
        ]
        self.job = LocalJob(
            "goodput", [], os.path.join(workdir, "job"), args, slices=SLICES, size="1Gi", jax_port=free_port("0.0.0.0")
        )
        self.spare = None  # ``bring_up`` starts it

    def _add_node(self, index: int, block: str | None = None):
        # google-auth would look for the GCE metadata server: from a loopback host's address no packet gets there.
        self.cluster.env = {"STORAGE_EMULATOR_HOST": self.stores.url(index), "NO_GCE_CHECK": "true"}
        return self.cluster.add_node(index, block=block)

    def bring_up(self) -> None:
        """Starts the coordinator and the node agents: a cluster's, up before the job (not in its wall time)."""
        self.cluster.coordinator.start()
        self.job.agents = [self._add_node(index) for index in range(NODES)]
        # The node that replaces the lost one, already up: a new node's boot (its agent's start with it) is
        # counted for no setup.
        self.spare = self._add_node(NODES, block=f"b{LOST_NODE // 2}")

    def start(self) -> None:
        self.job.create_pods()
        self.job.start_training()

    def kill(self) -> None:
        self.job.kill_training()

    def restart(self, kind: str) -> None:
        agents = None
        if kind == "node loss":
            agents, self.spare = replace_node(self.cluster, self.job, LOST_NODE, self.spare), None
        self.job.delete_pods()
        if agents:
            self.job.agents[:] = agents
        self.job.create_pods()
        self.job.start_training()

    def events(self) -> list[dict]:
        return [e for pod in self.job.pods for e in pod.events() if e.get("rank", 0) == 0]

    def error(self) -> str | None:
        failed = [p for p in self.job.pods if p.process and p.process.poll() not in (None, 0)]
        return (
            (first_error(failed[0].log_path + ".stderr") or f"{failed[0].name} exited {failed[0].process.returncode}")
            if failed
            else None
        )

    def last_error(self) -> str | None:
        return next(filter(None, (first_error(p.log_path + ".stderr") for p in self.job.pods)), None)

    def stop(self) -> None:
        self.job.kill_training()
        self.cluster.stop()


def read_events(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.startswith("{")]
    except FileNotFoundError:
        return []


_ERROR = re.compile(r"^\w*(Error|Exception)\b.*|DEADLINE_EXCEEDED.*")


def first_error(path: str) -> str | None:
    """The first exception line of a stderr file (e.g. ``ValueError: ...``), cut to 240 characters."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                match = _ERROR.search(line.strip())
                if match and not line.startswith((" ", "E1", "W1", "F1")):
                    return match.group(0)[:240]
    except FileNotFoundError:
        pass
    return None


def incarnation_of(events: list[dict], killed_at: float | None) -> Incarnation:
    inc = Incarnation(killed_at=killed_at)
    for e in events:
        if e["event"] == "restored":
            inc.restored = e["step"]
        elif e["event"] == "step":
            inc.steps[e["step"]] = e["time"]
        elif e["event"] == "saved":
            inc.saves.add(e["step"])
    return inc


@dataclasses.dataclass
class Run:
    """One setup's run in one regime: its incarnations, wall time, why it stopped early (if it did), the failures'
    kinds and its intervals."""

    setup: str
    incarnations: list[Incarnation]
    wall: float
    stopped: str | None = None
    regime: str = "loopback"
    kinds: list[str] = dataclasses.field(default_factory=list)
    intervals: Intervals = Intervals(0, 0)
    # At each failure and at the end: (the newest step logged, the newest step complete in the object store).
    backed_up: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)


_OURS_COMMIT = re.compile(r"^[^/]+/[^/]+/steps/([0-9]+)(?:-[0-9]+)?/COMMIT$")  # <ns>/<job>/steps/<step>[-<timeline>]
_ORBAX_COMMIT = re.compile(r"^([0-9]+)/commit_success\.txt$")  # <step>/: Orbax's files inside a step do not count


def newest_backup(stores: StoreFronts, prefix: str) -> int | None:
    """The newest step complete in the object store under the setup's ``prefix``: ours' backups
    (``.../<step>[-<timeline>]/COMMIT``) or Orbax's checkpoints on GCS (``<step>/commit_success.txt``)."""
    steps = []
    for blob in stores.admin.client().list_blobs(BUCKET, prefix=f"{prefix}/"):
        name = blob.name[len(prefix) + 1 :]
        if (found := _OURS_COMMIT.match(name) or _ORBAX_COMMIT.match(name)) is not None:
            steps.append(int(found.group(1)))
    return max(steps, default=None)


def run_setup(
    name: str, setup, plan: list[tuple[str, float]], final_gap: float, backed_up: Callable[[], int | None]
) -> Run:
    """Starts the job, applies ``plan``, trains ``final_gap`` more seconds, stops; returns what rank 0 logged.
    Prints, at each failure and at the end, the newest step complete in the object store (``backed_up``): what a
    cluster loss then would restore."""
    started = time.time()
    setup.start()
    incarnations: list[Incarnation] = []
    kinds = [kind for kind, _ in plan]
    stored: list[tuple[int, int | None]] = []
    for kind, gap in [*plan, ("end", final_gap)]:
        deadline = time.time() + RESTART_TIMEOUT
        while not any(e["event"] == "step" for e in setup.events()):
            error = setup.error()
            if error or time.time() > deadline:
                reason = f"no step within {RESTART_TIMEOUT:.0f} s of the restart" if not error else "a process exited"
                setup.kill()
                incarnations.append(incarnation_of(setup.events(), time.time()))
                detail = error or setup.last_error() or "no error printed"
                return Run(
                    name,
                    incarnations,
                    time.time() - started,
                    f"{reason} after failure {len(incarnations) - 1}: {detail}",
                    kinds=kinds,
                )
            time.sleep(0.1)
        first = min(e["time"] for e in setup.events() if e["event"] == "step")
        while time.time() < first + gap:
            if setup.error():
                setup.kill()
                incarnations.append(incarnation_of(setup.events(), time.time()))
                return Run(name, incarnations, time.time() - started, f"a process exited: {setup.error()}", kinds=kinds)
            time.sleep(0.1)
        killed_at = time.time()
        setup.kill()
        incarnations.append(incarnation_of(setup.events(), killed_at))
        stored.append((max(incarnations[-1].steps), backed_up()))
        print(
            f"  {name}: {kind} at step {stored[-1][0]} (restored {incarnations[-1].restored}); "
            f"newest complete in the object store: {stored[-1][1]}",
            flush=True,
        )
        if kind != "end":
            setup.restart(kind)
    return Run(name, incarnations, time.time() - started, kinds=kinds, backed_up=stored)


def ideal_step(runs: list[Run], quantile: float = 0.5) -> float:
    """The median (or ``quantile``) time of steps after which nothing was saved, over every run (seconds)."""
    gaps = [
        inc.steps[s + 1] - inc.steps[s]
        for run in runs
        for inc in run.incarnations
        for s in inc.steps
        if s + 1 in inc.steps and s not in inc.saves
    ]
    if quantile == 0.5:
        return statistics.median(gaps)
    return statistics.quantiles(gaps, n=100, method="inclusive")[round(quantile * 100) - 1]


@dataclasses.dataclass
class Figures:
    goodput: float
    kept: int
    lost: list[int]
    to_first_step: list[float]
    blocked: float


def figures(run: Run, ideal: float) -> Figures:
    incs = run.incarnations
    last = incs[-1]
    kept = max(last.steps) if last.steps and not run.stopped else (last.restored or 0)
    lost = [max(a.steps) - (b.restored or 0) for a, b in zip(incs, incs[1:]) if a.steps and b.steps]
    to_first = [min(b.steps.values()) - a.killed_at for a, b in zip(incs, incs[1:]) if b.steps]
    blocked = [inc.steps[s + 1] - inc.steps[s] - ideal for inc in incs for s in inc.saves if s + 1 in inc.steps]
    return Figures(
        kept * ideal / run.wall, kept, lost, to_first, statistics.median(blocked) if blocked else float("nan")
    )


def stalls(run: Run) -> list[tuple[int, float]]:
    """[(last step, seconds)] of the incarnations that logged no step for STALL_S or more before they were killed."""
    return [
        (max(inc.steps), inc.killed_at - max(inc.steps.values()))
        for inc in run.incarnations
        if inc.steps and inc.killed_at - max(inc.steps.values()) >= STALL_S
    ]


def stopped_training(run: Run) -> bool:
    """Whether the job had stopped training: it stopped early, its last incarnation stalled (``stalls``), or another
    stalled but inside a save. A stall inside a save (a saving step, or the first step, which Orbax saves when it has
    no checkpoint, without its ``saved`` event) is a save that blocks, waiting for the upload before it, say."""

    def in_save(inc: Incarnation, step: int) -> bool:
        every = (run.intervals.save, run.intervals.store)
        return step not in inc.saves and (step == min(inc.steps) or any(n and step % n == 0 for n in every))

    last = run.incarnations[-1]
    return bool(
        run.stopped
        or (last.steps and last.killed_at - max(last.steps.values()) >= STALL_S)
        or any(
            inc.steps and inc.killed_at - max(inc.steps.values()) >= STALL_S and not in_save(inc, max(inc.steps))
            for inc in run.incarnations
        )
    )


def modeled(run: Run, fig: Figures, rates: goodput_model.Rates) -> goodput_model.Costs:
    """The setup's costs at TARGET_BYTES per host: the measured blocking plus the extra bytes copied out of accelerator
    memory at ``rates.copy``; each measured restart plus the extra bytes copied back in at ``rates.restore`` and, on
    loopback, read from the tier it came from at the stated bandwidth (persistent only: the store at STORE_BW; the
    others: their own RAM after a preemption, a peer at NEAR_BW after the node loss), and where nothing was restored
    (no checkpoint had completed), the whole read at that bandwidth; the median of those. Persistent only cannot save
    again before its upload at STORE_BW ends."""
    extra = max(0.0, TARGET_BYTES - NODE_BYTES)
    restarts = []
    after = [inc for inc in run.incarnations[1:] if inc.steps]  # as ``fig.to_first_step``
    for kind, measured, inc in zip(run.kinds, fig.to_first_step, after):
        tier = STORE_BW if run.setup == "persistent" else NEAR_BW if kind == "node loss" else None
        # What the measurement lacks: on loopback, the tier's speed; where nothing was restored, the read itself.
        unread = TARGET_BYTES if inc.restored is None else extra if run.regime == "loopback" else 0.0
        restarts.append(measured + (unread / tier if tier else 0.0) + extra / rates.restore)
    return goodput_model.Costs(
        blocking=max(fig.blocked, 0.0) + extra / rates.copy,
        restart=statistics.median(restarts),
        min_interval=TARGET_BYTES / STORE_BW if run.setup == "persistent" else 0.0,
    )


def restart_for_goal(costs: goodput_model.Costs) -> float:
    """The restart (seconds) at which ``costs`` reach GOAL in the model, at the same blocking and interval (below 0:
    the blocking alone keeps it below)."""
    tau = goodput_model.interval(costs, MTBF_S)
    cycle = tau + costs.blocking
    return MTBF_S * (1 - GOAL * cycle / tau) - cycle / 2


# -- calibration ------------------------------------------------------------------------------------------------------

_STEP_DIR = re.compile(r"(?:^|/)(\d+)(?:-t\d+)?/")
_NODE_PART = re.compile(r"(?:ocdbt\.process_|rank-)(\d+)[/.]")


def node_upload_bytes(objects: list[tuple[str, int]]) -> int:
    """The bytes the busiest node uploaded for one save: over the steps in ``objects`` ((name under the setup's
    prefix, size)), the largest of a node's objects (Orbax's ``ocdbt.process_<i>/``, ours' ``rank-<r>/``) plus the
    step's objects of no node (metadata)."""
    per_node: dict[tuple[int, int], int] = {}
    shared: dict[int, int] = {}
    for name, size in objects:
        step = _STEP_DIR.search(name)
        if not step:
            continue
        node = _NODE_PART.search(name)
        if node:
            key = (int(step.group(1)), int(node.group(1)))
            per_node[key] = per_node.get(key, 0) + size
        else:
            shared[int(step.group(1))] = shared.get(int(step.group(1)), 0) + size
    return max((size + shared.get(step, 0) for (step, _), size in per_node.items()), default=0)


def upload_span(objects: list[tuple[str, float]]) -> float:
    """How long one upload took: over the steps in ``objects`` ((name under the setup's prefix, unix time created))
    that completed (Orbax's ``commit_success.txt``, ours' ``COMMIT``), the median of the seconds from a step's first
    object to its last; 0 if none completed."""
    times: dict[int, list[float]] = {}
    done = set()
    for name, created in objects:
        step = _STEP_DIR.search(name)
        if step:
            times.setdefault(int(step.group(1)), []).append(created)
            if name.endswith(("commit_success.txt", "/COMMIT")):
                done.add(int(step.group(1)))
    spans = [max(times[step]) - min(times[step]) for step in done]
    return statistics.median(spans) if spans else 0.0


def calibrate(names: list[str], stores: StoreFronts, workdir: str, make) -> tuple[Calibration, list[Run]]:
    """Runs each setup CALIBRATE_SECONDS with a save (and an upload) every CALIBRATE_EVERY steps, unlimited; measures
    its blocking per save and the bytes its busiest node uploads per save. Returns that and the runs (regime
    ``calibration``)."""
    runs: list[Run] = []
    upload: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for name in names:
        prefix = f"calibrate-{name}"
        every = Intervals(CALIBRATE_EVERY, 2 * CALIBRATE_EVERY if name == "emergency" else CALIBRATE_EVERY)
        setup = make(name, os.path.join(workdir, prefix), prefix, every)
        try:
            run = run_setup(name, setup, [], CALIBRATE_SECONDS, functools.partial(newest_backup, stores, prefix))
            runs.append(dataclasses.replace(run, intervals=every))
        finally:
            setup.stop()
        if runs[-1].stopped:
            raise RuntimeError(f"the calibration of {name} stopped: {runs[-1].stopped}")
        listed = list(stores.admin.client().list_blobs(BUCKET, prefix=prefix))
        upload[name] = node_upload_bytes([(b.name[len(prefix) + 1 :], b.size or 0) for b in listed])
        seconds[name] = upload_span([(b.name[len(prefix) + 1 :], b.time_created.timestamp()) for b in listed])
    step = ideal_step(runs)
    calibration = Calibration(
        step, {run.setup: figures(run, step).blocked for run in runs}, upload, seconds, ideal_step(runs, 0.1)
    )
    return calibration, [dataclasses.replace(run, regime="calibration") for run in runs]


# -- runs and the report ----------------------------------------------------------------------------------------------


def save_runs(path: str, calibration: Calibration, runs: list[Run]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {"calibration": dataclasses.asdict(calibration), "runs": [dataclasses.asdict(run) for run in runs]},
            f,
            default=sorted,
        )


def load_runs(path: str) -> tuple[Calibration | None, list[Run]]:
    """The calibration and runs a ``--save-runs`` file holds (a file of runs alone: one loopback regime, before)."""
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    raw = saved["runs"] if isinstance(saved, dict) else saved
    calibration = Calibration(**saved["calibration"]) if isinstance(saved, dict) else None
    return calibration, [
        Run(
            r["setup"],
            [
                Incarnation(i["restored"], {int(k): v for k, v in i["steps"].items()}, set(i["saves"]), i["killed_at"])
                for i in r["incarnations"]
            ],
            r["wall"],
            r["stopped"],
            r.get("regime", "loopback"),
            r.get("kinds", ["preemption", "node loss", "preemption", "preemption"]),
            Intervals(**r["intervals"]) if "intervals" in r else Intervals(0, 0),
            [tuple(pair) for pair in r.get("backed_up", [])],
        )
        for r in raw
    ]


def lag_verdict(run: Run) -> tuple[list[int], int, bool] | None:
    """What a cluster loss would have cost at each failure and at the end: ([the newest step logged minus the newest
    step complete in the object store (the whole step with none)], the bound, held?). The bound is the RPO stated in
    docs/tiers.md, one store interval plus one upload (``Intervals.upload``), against the newest step rather than
    the newest safe one (stricter by the steps not yet safe). None when the run kept no record of it."""
    if not run.backed_up or not run.intervals.upload:
        return None
    lags = [step - (stored or 0) for step, stored in run.backed_up]
    bound = run.intervals.store + run.intervals.upload
    return lags, bound, max(lags) <= bound


def regime_of(name: str) -> Regime:
    return Regime.realistic(NODE_BYTES) if name == "realistic" else LOOPBACK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--failures", type=int, default=4)
    parser.add_argument("--gap-seconds", type=float, default=30.0, help="Training seconds before each failure.")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument(
        "--gpu-results",
        default=goodput_model.GPU_RESULTS,
        help="torch_gpu's JSON lines (--out): the model takes their measured copy rates (ours async_save) "
        "instead of the stated assumption ('': assume; default: the H200 run in docs/results)",
    )
    parser.add_argument("--save-runs", help="Also write the calibration and every incarnation's events here (JSON).")
    parser.add_argument("--from-runs", help="Run nothing: report the runs a --save-runs file holds.")
    args = parser.parse_args()
    names, regimes = args.setups.split(","), args.regimes.split(",")
    if set(names) - set(SETUPS):
        parser.error(f"--setups takes {', '.join(SETUPS)}")
    if set(regimes) - set(REGIMES):
        parser.error(f"--regimes takes {', '.join(REGIMES)}")
    try:
        plan = schedule(args.seed, args.failures, args.gap_seconds)
    except ValueError as err:
        parser.error(str(err))
    rates = gpu_rates(args.gpu_results)
    if args.from_runs:
        calibration, runs = load_runs(args.from_runs)
        report(calibration, runs, rates)
        return
    mtbf = statistics.mean(gap for _, gap in plan)
    print(f"seed {args.seed}: " + ", ".join(f"{kind} after {gap:.0f} s" for kind, gap in plan), flush=True)
    subnet = network.run_subnet()
    hosts = [f"{subnet}.{i + 1}" for i in range(NODES + 1)]  # the nodes and ours' spare
    runs: list[Run] = []
    with scratch_dir("mtc-bench-goodput-") as (workdir, cleanup):
        stores = StoreFronts(require_tool("fake-gcs-server"), os.path.join(workdir, "object-store"), NODES + 1)
        cleanup.callback(stores.stop)
        stores.start().admin.client().create_bucket(BUCKET)
        cleanup.enter_context(network.loopback_hosts(hosts))

        def make(name: str, path: str, prefix: str, intervals: Intervals):
            setup: Ours | OrbaxOnly
            if name == "ours":
                setup = Ours(path, stores, prefix, intervals, subnet)
                cleanup.callback(setup.stop)
                setup.bring_up()
            else:
                setup = OrbaxOnly(name, path, stores, prefix, intervals)
                cleanup.callback(setup.stop)
            return setup

        print(f"calibration: each setup {CALIBRATE_SECONDS:.0f} s, a save every {CALIBRATE_EVERY} steps", flush=True)
        calibration, runs = calibrate(names, stores, workdir, make)
        for name in regimes:
            regime = regime_of(name)
            print(f"== {regime.describe(NODE_BYTES)}", flush=True)
            with regime.links(stores.ports, hosts):
                for setup_name in names:
                    intervals = intervals_for(setup_name, calibration, regime, mtbf)
                    prefix = f"{name}-{setup_name}"
                    setup = make(setup_name, os.path.join(workdir, prefix), prefix, intervals)
                    try:
                        run = run_setup(
                            setup_name, setup, plan, args.gap_seconds, functools.partial(newest_backup, stores, prefix)
                        )
                    finally:
                        setup.stop()
                    runs.append(dataclasses.replace(run, regime=name, intervals=intervals))
            print(
                f"   load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} after the {name} regime", flush=True
            )
    if args.save_runs:
        save_runs(args.save_runs, calibration, runs)
    report(calibration, runs, rates)


def gpu_rates(path: str | None) -> goodput_model.Rates:
    """The accelerator copy rates of the model: torch_gpu's (``ours async_save``) from ``path``, else the stated
    assumption."""
    if not path:
        return goodput_model.ASSUMED
    with open(path, encoding="utf-8") as f:
        try:
            return goodput_model.torch_gpu_rates(f.readlines())
        except ValueError as error:
            print(f"note: the model assumes its rates: {path}: {error}")
            return goodput_model.ASSUMED


def report(calibration: Calibration | None, runs: list[Run], rates: goodput_model.Rates) -> None:
    if calibration:
        print(
            f"\ncalibration (a save every {CALIBRATE_EVERY} steps, unlimited): ideal step {calibration.step:.3f} s "
            f"(fast: {calibration.fast_step:.3f} s); "
            + "; ".join(
                f"{name}: blocked {calibration.blocking[name]:.3f} s per save, busiest node uploads "
                f"{calibration.upload_bytes[name] / 2**20:.1f} MiB per save in "
                f"{calibration.upload_seconds.get(name, float('nan')):.1f} s"
                for name in calibration.blocking
            )
        )
    goals = []
    for name in dict.fromkeys(run.regime for run in runs if run.regime in REGIMES):
        goals.append(report_regime(name, [run for run in runs if run.regime == name], rates))
    print(
        f"model: {goodput_model.FORMULA}; a failure every {MTBF_S / 60:.0f} min; {TARGET_BYTES / 1e9:.2f} GB/host "
        f"copied out at {rates.copy / 1e9:.0f} GB/s and back in at {rates.restore / 1e9:.1f} GB/s per host "
        f"({rates.source}); on loopback the tier's read added at {STORE_BW / 1e9:.2f} GB/s (store) or "
        f"{NEAR_BW / 1e9:.0f} GB/s (peer)"
    )
    for line in goals:
        print(line)
    print(
        f"{BALLAST_MIB} MiB per process, {NODES} processes (nodes); {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end."
    )


def report_regime(name: str, runs: list[Run], rates: goodput_model.Rates) -> str:
    """Prints ``name``'s table; returns its goal line."""
    ideal = ideal_step(runs)
    print(f"\n{regime_of(name).describe(NODE_BYTES)}")
    for run in runs:
        print(
            f"  {run.setup}: saves every {run.intervals.save} steps, to the store every {run.intervals.store} "
            f"({run.intervals.why})"
        )
    print(
        f"{'setup':<11}{'goodput':>8}{'kept':>6}{'wall s':>8}{'every':>8}  {'steps lost per failure':<24}"
        f"{'failure→step s':<26}{'blocked/save s':>15}  model @26 GB/host, MTBF 10 min: goodput (δ, R, τ s)"
    )
    results = {}
    results_rpo: dict[str, bool] = {}
    for run in runs:
        fig = figures(run, ideal)
        stalled = stalls(run)
        costs = None
        if stopped_training(run) or not fig.to_first_step:
            model, modeled_text = float("nan"), "— (it stopped training: the model assumes it keeps training)"
        else:
            costs = modeled(run, fig, rates)
            model = goodput_model.goodput(costs, MTBF_S)
            modeled_text = (
                f"{model:.3f} ({costs.blocking:.2f}, {costs.restart:.1f}, {goodput_model.interval(costs, MTBF_S):.0f})"
            )
        results[run.setup] = (fig.goodput, model, costs)
        every = f"{run.intervals.save}/{run.intervals.store}"
        print(
            f"{run.setup:<11}{fig.goodput:>8.3f}{fig.kept:>6}{run.wall:>8.0f}{every:>8}  {str(fig.lost):<24}"
            f"{str([round(s, 1) for s in fig.to_first_step]):<26}{fig.blocked:>15.3f}  {modeled_text}"
        )
        if run.stopped:
            print(f"{'':<11}stopped: {run.stopped}")
        for step, seconds in stalled:
            print(f"{'':<11}stalled: no step after step {step} for {seconds:.0f} s before the failure")
        if stalled and not stopped_training(run):
            print(f"{'':<11}(each inside a save: a save that blocked, the job still training)")
        if (verdict := lag_verdict(run)) is not None:
            lags, bound, held = verdict
            print(
                f"{'':<11}cluster loss would lose, at each failure and the end: {lags} steps (bound: store "
                f"{run.intervals.store} + upload {run.intervals.upload} = {bound}: {'held' if held else 'MISSED'})"
            )
            results_rpo[run.setup] = held
    print(f"ideal step {ideal:.3f} s (median of steps without a save, this regime's setups); every: save/store steps")
    ours = results.get("ours")
    if not ours:
        return f"goal ({name}): ours not run"
    others = {n: g for n, (g, _, _) in results.items() if n != "ours"}
    above = all(ours[0] > g for g in others.values())
    line = (
        f"goal ({name}): ours above every alternative in this run: {'MET' if above else 'MISSED'} ({ours[0]:.3f} vs "
        f"{', '.join(f'{n} {g:.3f}' for n, g in others.items())}); ours >= {GOAL} in the model: "
        f"{'MET' if ours[1] >= GOAL else 'MISSED'} ({ours[1]:.3f}; modeled: "
        f"{', '.join(f'{n} {m:.3f}' for n, (_, m, _) in results.items())})"
    )
    if "ours" in results_rpo:
        line += f"; ours' RPO within its bound at every failure: {'MET' if results_rpo['ours'] else 'MISSED'}"
    if ours[2] is not None:  # modeled: it kept training
        ceiling = goodput_model.goodput(dataclasses.replace(ours[2], restart=0.0), MTBF_S)
        line += (
            f"; at ours' δ {ours[2].blocking:.2f} s an instant restart gives {ceiling:.3f}, {GOAL} needs a restart "
            f"of at most {restart_for_goal(ours[2]):.1f} s (modeled {ours[2].restart:.1f})"
        )
    return line


if __name__ == "__main__":
    main()
