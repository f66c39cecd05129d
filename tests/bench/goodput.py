"""Goodput under failures: one real JAX job, one seeded failure schedule, three checkpointing setups, one run.

    python -m tests.bench.goodput [--seed N] [--failures K] [--gap-seconds S] [--setups persistent,emergency,ours]
                                  [--save-runs FILE] [--from-runs FILE]  # keep the events; report kept ones again

The job is ``examples/train.py``'s (4 JAX processes, 2 slices x 2, BALLAST_MIB MiB per process, the same across
slices: a data-parallel state), trained without end and checkpointed three ways:

The object store is a real fake-gcs-server (GCS's JSON API, objects on the local disk), one bucket, a prefix per
setup. Orbax reaches it as ``gs://`` through tensorstore's GCS driver (``TENSORSTORE_GCS_HTTP_URL``) and etils'
epath through gcsfs (``STORAGE_EMULATOR_HOST``); our agents through google-cloud-storage.

1. ``persistent``: Orbax's ordinary ``CheckpointManager`` (async saves) every PERSIST_EVERY steps to the object
   store (``tests/bench/orbax_job.py``).
2. ``emergency``: ``orbax.checkpoint.experimental.emergency`` ``CheckpointManager``: local saves every SAVE_EVERY
   steps to a tmpfs per node, persistent saves every PERSIST_EVERY steps to the object store.
3. ``ours``: the node agents and coordinator (``examples/local_cluster.py``; tmpfs ramdisks, peer tier, backups
   every PERSIST_EVERY steps to the object store) under ``ReplicatorCheckpointManager``, local saves every
   SAVE_EVERY steps, async (``--async-save``).

(The PyTorch job with NVRx local checkpointing beside ours is the ``torch_vs_nvrx`` bench.)

The failure schedule (``schedule``): a preemption, a node loss, then preemptions, each GAP seconds of training
after the first step of the incarnation before it (the later gaps seeded within +-25 %). A failure SIGKILLs every
training process; a preemption keeps the nodes (and their tmpfs), a node loss also loses node 3's RAM: its
tmpfs is emptied (ours: the agent dies with its ramdisk and a fresh node, already up, takes its place: a new node's
boot is counted for no setup). The job is then started again.
A setup whose job logs no step within RESTART_TIMEOUT seconds of a restart, or whose process exits with an
error, stops there; its row says so with the error.

Printed per setup, from rank 0's step events: goodput = steps kept x ideal step time / wall time (from the job's
first start, with the object store and ours' coordinator and agents already up, as a cluster's are; the ideal is
the median step time of steps after which nothing was saved, over all setups); steps lost per failure; seconds
from each failure to the first step after it; training time blocked per save (the step after a save, minus the
ideal). Beside each row, the model (``tests/bench/goodput_model.py``, Young 1974 / Daly 2006) at the seed's
70B model on 32 hosts (TARGET_BYTES per host), a failure every MTBF_S seconds, the object store at STORE_BW and
the node's RAM or a peer at NEAR_BW per host. Run as root (tmpfs): ``python -m tests.bench.goodput``.
"""

import argparse
import dataclasses
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

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, LocalJob, can_mount_tmpfs, scratch_dir, unmount_all_below
from tests.bench import goodput_model
from tests.bench.goodput_model import COPY_BW, MTBF_S, NEAR_BW, STORE_BW, TARGET_BYTES
from tests.helpers.jobs import replace_node
from tests.helpers.ports import free_port, listen_address
from tests.helpers.servers import FakeGcsServer
from tests.helpers.tools import require_tool

NODES, SLICES, LOST_NODE = 4, 2, 3
BALLAST_MIB = 64
SAVE_EVERY, PERSIST_EVERY = 10, 20
STEP_SLEEP = 0.2
RESTART_TIMEOUT = 150.0
STALL_S = 10.0  # no step for this long before a failure: the job had stopped training (the row says so)
SETUPS = ("persistent", "emergency", "ours")
BUCKET = "goodput"
GOAL = 0.95
ORBAX_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orbax_job.py")


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


@dataclasses.dataclass
class Incarnation:
    """One start of the job: what rank 0 logged, and how it ended."""

    restored: int | None = None
    steps: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> unix time logged
    saves: set[int] = dataclasses.field(default_factory=set)
    killed_at: float | None = None


class OrbaxOnly:
    """The job under ``tests/bench/orbax_job.py`` (``mode``: persistent or emergency): 4 plain processes, no agents."""

    def __init__(self, mode: str, workdir: str, store: FakeGcsServer):
        self.mode, self.workdir, self.store_url = mode, workdir, store.url
        self.persistent = f"gs://{BUCKET}/{mode}"
        # Orbax's emergency manager wants its persistent directory to exist: on a bucket, a prefix holding an object.
        store.client().bucket(BUCKET).blob(f"{mode}/.created").upload_from_string(b"")
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
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "TENSORSTORE_GCS_HTTP_URL": self.store_url,
            "STORAGE_EMULATOR_HOST": self.store_url,
        }
        self.processes = []
        for rank in range(NODES):
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
                str(SAVE_EVERY),
                "--persistent-interval-steps",
                str(PERSIST_EVERY),
                "--ballast-mib",
                str(BALLAST_MIB),
                "--step-sleep",
                str(STEP_SLEEP),
            ]
            with open(self._log(rank) + ".jsonl", "wb") as out, open(self._log(rank) + ".stderr", "wb") as err:
                self.processes.append(subprocess.Popen(command, stdout=out, stderr=err, env=env))

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


class Ours:
    """The job under our agents: ``examples/train.py`` on a ``LocalCluster``."""

    def __init__(self, workdir: str, store_url: str):
        self.cluster = LocalCluster(
            os.path.join(workdir, "cluster"),
            listen_address,
            replicas=1,
            backup=f"gs://{BUCKET}/ours",
            env={"STORAGE_EMULATOR_HOST": store_url},
        )
        args = [
            "--steps",
            "1000000",
            "--save-interval-steps",
            str(SAVE_EVERY),
            "--backup-interval-steps",
            str(PERSIST_EVERY),
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

    def bring_up(self) -> None:
        """Starts the coordinator and the node agents: a cluster's, up before the job (not in its wall time)."""
        self.job.agents = list(self.cluster.start(NODES).agents)
        # The node that replaces the lost one, already up: a new node's boot (its agent's start with it) is
        # counted for no setup.
        self.spare = self.cluster.add_node(NODES, block=f"b{LOST_NODE // 2}")

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
    """One setup's run: its incarnations, wall time, and why it stopped early (if it did)."""

    setup: str
    incarnations: list[Incarnation]
    wall: float
    stopped: str | None = None


def run_setup(name: str, setup, plan: list[tuple[str, float]], final_gap: float) -> Run:
    """Starts the job, applies ``plan``, trains ``final_gap`` more seconds, stops; returns what rank 0 logged."""
    started = time.time()
    setup.start()
    incarnations: list[Incarnation] = []
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
                )
            time.sleep(0.1)
        first = min(e["time"] for e in setup.events() if e["event"] == "step")
        while time.time() < first + gap:
            if setup.error():
                setup.kill()
                incarnations.append(incarnation_of(setup.events(), time.time()))
                return Run(name, incarnations, time.time() - started, f"a process exited: {setup.error()}")
            time.sleep(0.1)
        killed_at = time.time()
        setup.kill()
        incarnations.append(incarnation_of(setup.events(), killed_at))
        print(
            f"  {name}: {kind} at step {max(incarnations[-1].steps)} (restored {incarnations[-1].restored})", flush=True
        )
        if kind != "end":
            setup.restart(kind)
    return Run(name, incarnations, time.time() - started)


def ideal_step(runs: list[Run]) -> float:
    """The median time of steps after which nothing was saved, over every run (seconds)."""
    gaps = [
        inc.steps[s + 1] - inc.steps[s]
        for run in runs
        for inc in run.incarnations
        for s in inc.steps
        if s + 1 in inc.steps and s not in inc.saves
    ]
    return statistics.median(gaps)


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


def modeled(name: str, fig: Figures, copy_bw: float = COPY_BW) -> tuple[float, goodput_model.Costs]:
    """(goodput, costs) of the setup at TARGET_BYTES per host and a failure every MTBF_S, from its measured blocking
    and restart: saves copy at ``copy_bw`` bytes/s; persistent only restores and uploads at STORE_BW, the others
    restore from RAM or a peer at NEAR_BW."""
    measured = goodput_model.Costs(blocking=max(fig.blocked, 0.0), restart=statistics.median(fig.to_first_step))
    store = name == "persistent"
    costs = goodput_model.scaled(
        measured,
        BALLAST_MIB * 2**20,
        TARGET_BYTES,
        copy_bw,
        STORE_BW if store else NEAR_BW,
        STORE_BW if store else None,
    )
    return goodput_model.goodput(costs, MTBF_S), costs


def copy_bandwidth_for_goal(name: str, fig: Figures) -> float | None:
    """The copy out of accelerator memory (bytes/s per host, COPY_BW doubled up to 64 times) at which the setup's
    model reaches GOAL, or None: its restart alone keeps it below."""
    return next((COPY_BW * k for k in (1, 2, 4, 8, 16, 32, 64) if modeled(name, fig, COPY_BW * k)[0] >= GOAL), None)


def load_runs(path: str) -> list[Run]:
    """The runs a ``--save-runs`` file holds."""
    with open(path, encoding="utf-8") as f:
        runs = json.load(f)
    return [
        Run(
            r["setup"],
            [
                Incarnation(i["restored"], {int(k): v for k, v in i["steps"].items()}, set(i["saves"]), i["killed_at"])
                for i in r["incarnations"]
            ],
            r["wall"],
            r["stopped"],
        )
        for r in runs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--failures", type=int, default=4)
    parser.add_argument("--gap-seconds", type=float, default=30.0, help="Training seconds before each failure.")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--save-runs", help="Also write every incarnation's events here (JSON).")
    parser.add_argument("--from-runs", help="Run nothing: report the runs a --save-runs file holds.")
    args = parser.parse_args()
    names = args.setups.split(",")
    if set(names) - set(SETUPS):
        parser.error(f"--setups takes {', '.join(SETUPS)}")
    try:
        plan = schedule(args.seed, args.failures, args.gap_seconds)
    except ValueError as err:
        parser.error(str(err))
    if args.from_runs:
        runs = load_runs(args.from_runs)
        report(runs, ideal_step(runs))
        return
    print(f"seed {args.seed}: " + ", ".join(f"{kind} after {gap:.0f} s" for kind, gap in plan), flush=True)
    runs = []
    with scratch_dir("mtc-bench-goodput-") as (workdir, cleanup):
        store = FakeGcsServer(require_tool("fake-gcs-server"), data_dir=os.path.join(workdir, "object-store")).start()
        cleanup.callback(store.stop)
        store.client().create_bucket(BUCKET)
        for name in names:
            path = os.path.join(workdir, name)
            setup = Ours(path, store.url) if name == "ours" else OrbaxOnly(name, path, store)
            if isinstance(setup, Ours):
                cleanup.callback(setup.stop)
                setup.bring_up()
            else:
                cleanup.callback(setup.kill)
            runs.append(run_setup(name, setup, plan, args.gap_seconds))
            if isinstance(setup, Ours):
                setup.stop()
    if args.save_runs:
        with open(args.save_runs, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(run) for run in runs], f, default=sorted)
    report(runs, ideal_step(runs))


def report(runs: list[Run], ideal: float) -> None:
    print(
        f"\n{'setup':<11}{'goodput':>8}{'kept':>6}{'wall s':>8}  {'steps lost per failure':<24}{'failure→step s':<26}"
        f"{'blocked/save s':>15}  model @26 GB/host, MTBF 10 min: goodput (δ, R, τ s)"
    )
    results = {}
    for run in runs:
        fig = figures(run, ideal)
        stalled = stalls(run)
        if run.stopped or stalled or not fig.to_first_step:
            model, modeled_text = float("nan"), "— (it stopped training: the model assumes it keeps training)"
        else:
            model, costs = modeled(run.setup, fig)
            modeled_text = (
                f"{model:.3f} ({costs.blocking:.1f}, {costs.restart:.1f}, {goodput_model.interval(costs, MTBF_S):.0f})"
            )
        results[run.setup] = (fig.goodput, model, fig)
        print(
            f"{run.setup:<11}{fig.goodput:>8.3f}{fig.kept:>6}{run.wall:>8.0f}  {str(fig.lost):<24}"
            f"{str([round(s, 1) for s in fig.to_first_step]):<26}{fig.blocked:>15.3f}  {modeled_text}"
        )
        if run.stopped:
            print(f"{'':<11}stopped: {run.stopped}")
        for step, seconds in stalled:
            print(f"{'':<11}stalled: no step after step {step} for {seconds:.0f} s before the failure")
    ours = results.get("ours")
    if ours:
        others = [g for name, (g, _, _) in results.items() if name != "ours"]
        above = all(ours[0] > g for g in others)
        print(
            f"goal: ours above every alternative in this run: {'MET' if above else 'MISSED'} "
            f"({ours[0]:.3f} vs {', '.join(f'{n} {g:.3f}' for n, (g, _, _) in results.items() if n != 'ours')}); "
            f"ours >= {GOAL} in the model: {'MET' if ours[1] >= GOAL else 'MISSED'} ({ours[1]:.3f}; modeled: "
            f"{', '.join(f'{n} {m:.3f}' for n, (_, m, _) in results.items())})"
        )
        if not math.isnan(ours[1]):  # modeled: it kept training
            # What the copy out of accelerator memory alone allows: the same blocking with an instant restart.
            costs = modeled("ours", ours[2])[1]
            ceiling = goodput_model.goodput(dataclasses.replace(costs, restart=0.0), MTBF_S)
            needed = copy_bandwidth_for_goal("ours", ours[2])
            print(
                f"model: at ours' δ {costs.blocking:.2f} s an instant restart would give {ceiling:.3f}; ours reaches {GOAL} with the "
                f"{f'copy out at {needed / 1e9:.0f} GB/s per host' if needed else 'copy out at no bandwidth up to 64x: its restart keeps it below'}"
            )
    print(
        f"ideal step {ideal:.3f} s (median of steps without a save, all setups); {BALLAST_MIB} MiB per process; local saves "
        f"every {SAVE_EVERY} steps, persistent every {PERSIST_EVERY}; persistent tier: fake-gcs-server on loopback. "
        f"Model: {goodput_model.FORMULA}; δ, R measured plus the extra bytes to {TARGET_BYTES / 1e9:.2f} GB/host: copied out at {COPY_BW / 1e9:.0f} "
        f"GB/s, read from the object store at {STORE_BW / 1e9:.2f} GB/s or RAM/peer at {NEAR_BW / 1e9:.0f} GB/s per host. "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )


if __name__ == "__main__":
    main()
