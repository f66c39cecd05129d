"""Our PyTorch checkpointing against NVIDIA NVRx local checkpointing on the same job, in one run.

The job (``tests/bench/torch_job.py``): 2 nodes x 2 processes under torchrun (static rendezvous on 127.0.0.1,
gloo, CPU), FSDP2 over LAYERS x Linear(WIDTH, WIDTH) with AdamW, each rank checkpointing its own shards
(about 25 MiB per rank at the defaults). It runs three ways, one after the other:

- none: no checkpointing: the step time every ratio is taken against;
- NVRx: ``nvidia-resiliency-ext`` 0.7.0 ``LocalCheckpointManager`` on a tmpfs per node, replicated in-process by
  ``CliqueReplicationStrategy`` to the rank LOCAL_WORLD_SIZE away (the other node), synchronous ``save()``. NVRx's
  local checkpointing is CUDA-only in four device calls; it runs here through a device-only shim
  (``tests/bench/nvrx_device_shim.py``), which the output names;
- ours: ``mtc_torch.CheckpointManager`` (blocking ``save``) on each pod's mount of our ramdisk, with a coordinator
  and two real ``mtc node`` agents (peer tier, one replica per step, ``framework: pytorch.distributed``), backing up
  to an object store as slow against the job's bytes as a real one (fake-gcs-server, the goodput bench's realistic
  store link per node: ``goodput_regime``), no more often than a node's upload takes (NVRx has no backup tier);
- ours, async: the same with ``async_save`` (its blocking part is the staging; NVRx's async path is not run,
  see ``nvrx_device_shim``).

Per checkpointing setup:

- blocking: the job saves every SAVE_EVERY steps; the median of (train + save) seconds over the saving steps
  after WARMUP_STEPS, divided by the median step time without checkpointing;
- all steps: the mean step time over every step after WARMUP_STEPS against no checkpointing (what background work,
  such as our agents replicating or an async save's writes, takes from training on the same cores);
- node-loss restore, NODE_LOSSES times: once the job has saved its last step (and, for ours, that step has its
  replica on the other node) and exited, node 1's local storage is wiped (NVRx: its tmpfs; ours: the agent dies with
  its ramdisk and a fresh node joins), the pods are recreated and the job restarted: seconds from the recreation to
  the first training step (global rank 0's ``step`` event), split into recreation -> process start and process
  start -> state loaded. Each restore is checked against the state the job had when it saved that step (a CRC32 of
  every rank's tensors); each restarted incarnation trains and saves SAVE_EVERY more steps before the next loss.

Beside each row, the model of ``goodput_model`` at the seed's sizes, with the copy rates ``torch_gpu`` measured
(``--gpu-results``, by default one H200's run in docs/results) or else the H200 probe's (``goodput_model.ASSUMED``, printed with its source).

The goal is ours at or below NVRx on both, like for like: ours with the blocking ``save`` against NVRx's sync save. Timings are printed, not asserted. Run as root (tmpfs mounts):
``python -m tests.bench.torch_vs_nvrx --python .venv-nvrx/bin/python`` (``make bench`` builds that venv).
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import psutil

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, Pod, can_mount_tmpfs, scratch_dir
from examples.torchrun_job import TorchrunJob
from tests.bench import goodput_model
from tests.bench.goodput_model import MTBF_S, NEAR_BW, TARGET_BYTES
from tests.bench.goodput_regime import Regime, StoreFronts
from tests.bench.nvrx_device_shim import NAME as SHIM
from tests.helpers import network
from tests.helpers.ports import free_port, listen_address
from tests.helpers.tools import require_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_SCRIPT = os.path.join(ROOT, "tests", "bench", "torch_job.py")
NODES, PROCS = 2, 2
SAVE_EVERY = 2
WARMUP_STEPS = 4
SAVES = 6
OURS, OURS_ASYNC, NVRX = "ours (mtc_torch save)", "ours (async_save)", "NVRx 0.7.0 (sync save)"
# Each setup's row in tests/bench/torch_gpu.py's output, whose rates the model takes with --gpu-results.
GPU_SETUP = {OURS: "ours save", OURS_ASYNC: "ours async_save", NVRX: "NVRx 0.7.0 sync"}
STEPS = WARMUP_STEPS + SAVES * SAVE_EVERY
NODE_LOSSES = 2  # per checkpointing setup; each restarted incarnation trains and saves SAVE_EVERY more steps
WAIT_SECONDS = 300.0


def torchrun(python: str, node_rank: int, port: int, mode: str, local_dir: str, job_args: list[str]) -> list[str]:
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(NODES),
        "--nproc-per-node",
        str(PROCS),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        JOB_SCRIPT,
        "--mode",
        mode,
        "--local-dir",
        local_dir,
        *job_args,
    ]


def job_env() -> dict[str, str]:
    """The job's environment: this checkout first on the path (``mtc_torch``, the shim), gloo on loopback,
    one thread per process; torchrun gives each worker its ranks (the node rank as ``GROUP_RANK``)."""
    return {
        **os.environ,
        "PYTHONPATH": ROOT,
        "GLOO_SOCKET_IFNAME": "lo",
        "NNODES": str(NODES),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def start(command: list[str], log_path: str) -> subprocess.Popen:
    """One node's torchrun."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "wb") as out, open(log_path + ".stderr", "wb") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, env=job_env())


def kill(process: subprocess.Popen | None) -> None:
    """SIGKILLs a node's torchrun and every process below it (torchrun starts its workers in their own sessions)."""
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        psutil.wait_procs(tree, timeout=30)
    process.wait()


def events(log_path: str) -> list[dict]:
    try:
        with open(log_path, encoding="utf-8") as log:
            return [json.loads(line) for line in log if line.startswith("{")]
    except FileNotFoundError:
        return []


def tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return ""


def wait_for(condition, processes: list[subprocess.Popen], logs: list[str], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if condition():
            return
        for process in processes:
            if process.poll() not in (None, 0):
                last = (events(logs[0]) or [None])[-1]
                tails = "".join(
                    f"\n--- node {n} ({p.poll()}), {path}.stderr:\n{tail(path + '.stderr')}"
                    for n, (p, path) in enumerate(zip(processes, logs))
                )
                raise RuntimeError(f"{what}: a node exited {process.returncode} (rank 0's last event: {last}){tails}")
        time.sleep(0.05)
    raise TimeoutError(f"{what} not reached within {WAIT_SECONDS} s")


@dataclasses.dataclass
class Run:
    """What one setup measured."""

    step_s: list[float] = dataclasses.field(default_factory=list)  # train + save of the saving steps timed
    all_s: list[float] = dataclasses.field(default_factory=list)  # train + save of every step timed
    save_s: list[float] = dataclasses.field(default_factory=list)
    restore_s: list[float] = dataclasses.field(default_factory=list)  # per node loss: recreation -> first step
    launch_s: list[float] = dataclasses.field(default_factory=list)  # recreation -> rank 0's process started
    load_s: list[float] = dataclasses.field(default_factory=list)  # process start -> state loaded
    restored_steps: list[int] = dataclasses.field(default_factory=list)
    bit_identical: list[bool] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)  # where each node's restore came from
    exits: list[str] = dataclasses.field(default_factory=list)  # trainers that failed after their last save
    note: str = ""


def measure(run: "Run", run_events: list[dict]) -> None:
    """Fills ``step_s``, ``save_s`` (the saving steps; every step without checkpointing) and ``all_s`` (every step)."""
    steps = [e for e in run_events if e["event"] == "step" and e["step"] > WARMUP_STEPS]
    saving = [e for e in steps if e["saved"]] or steps
    run.step_s = [e["train_s"] + e["save_s"] for e in saving]
    run.save_s = [e["save_s"] for e in saving]
    run.all_s = [e["train_s"] + e["save_s"] for e in steps]


def check_restore(run: Run, before: list[dict], after: list[dict], recreated_at: float) -> None:
    """Records one node loss: the restored step, whether it equals what was saved, and its times."""
    restored = next(e for e in after if e["event"] == "restored")
    saved = {e["step"]: e["crcs"] for e in before if e["event"] == "saved"}
    started = next(e["time"] for e in after if e["event"] == "start")
    run.restored_steps.append(restored["step"])
    run.bit_identical.append(saved.get(restored["step"]) == restored["crcs"])
    run.restore_s.append(min(e["time"] for e in after if e["event"] == "step") - recreated_at)
    run.launch_s.append(started - recreated_at)
    run.load_s.append(restored["time"] - started)


def wait_trained(run: Run, processes: list[subprocess.Popen], logs: list[str], step: int, who: str) -> None:
    """Waits until rank 0 reported step ``step`` saved and every node's torchrun exited. A node that fails after that
    (at exit) is recorded in ``run.exits`` and printed, not hidden: the next restore then shows which step survived."""
    wait_for(
        lambda: any(e["event"] == "saved" and e["step"] == step for e in events(logs[0])),
        processes,
        logs,
        f"{who}: step {step} saved",
    )
    deadline = time.monotonic() + WAIT_SECONDS
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    for node, (process, log) in enumerate(zip(processes, logs)):
        if process.poll() != 0:
            causes = [
                line
                for line in tail(log + ".stderr", 100_000).splitlines()
                if "terminate called" in line or "Error:" in line
            ]
            run.exits.append(
                f"node {node}'s torchrun exited {process.poll()} after step {step} was saved ({'; '.join(causes[-2:])})"
            )


def target(loss: int) -> int:
    """The last step (saved) of the incarnation before node loss ``loss`` (0-based)."""
    return STEPS + loss * SAVE_EVERY


class NVRxSetup:
    """NVRx on a tmpfs per node (a plain directory when not root); its node loss wipes node 1's."""

    name = NVRX

    def __init__(self, python: str, workdir: str, job_args: list[str]):
        self.python, self.workdir, self.job_args = python, workdir, job_args
        self.dirs = [os.path.join(workdir, f"node-{n}") for n in range(NODES)]

    def _mount(self, n: int) -> None:
        os.makedirs(self.dirs[n], exist_ok=True)
        if can_mount_tmpfs():
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", self.dirs[n]], check=True)

    def _launch(self, incarnation: int, steps: int) -> tuple[list[subprocess.Popen], list[str]]:
        port = free_port("127.0.0.1")
        logs = [os.path.join(self.workdir, "logs", f"i{incarnation}-node-{n}.jsonl") for n in range(NODES)]
        args = [*self.job_args, "--steps", str(steps), "--save-every", str(SAVE_EVERY)]
        return [start(torchrun(self.python, n, port, "nvrx", self.dirs[n], args), logs[n]) for n in range(NODES)], logs

    def run(self) -> Run:
        run = Run()
        for n in range(NODES):
            self._mount(n)
        processes, logs = self._launch(0, target(0))
        try:
            for loss in range(NODE_LOSSES):
                wait_trained(run, processes, logs, target(loss), "NVRx")
                before = events(logs[0])
                if loss == 0:
                    measure(run, before)
                subprocess.run(
                    ["umount", "-l", self.dirs[1]], check=False, capture_output=True
                )  # node 1 lost, RAM gone
                subprocess.run(["rm", "-rf", "--one-file-system", self.dirs[1]], check=True)
                recreated_at = time.time()
                self._mount(1)
                processes, logs = self._launch(loss + 1, target(loss + 1))
                wait_for(
                    lambda: any(e["event"] == "step" for e in events(logs[0])),
                    processes,
                    logs,
                    "NVRx: the first step after the node loss",
                )
                check_restore(run, before, events(logs[0]), recreated_at)
                run.sources.append("node 1's ranks from their clique peers on node 0 (NVRx's retrieve plan)")
        finally:
            for p in processes:
                kill(p)
        return run


@dataclasses.dataclass
class BenchTorchrunJob(TorchrunJob):
    """``TorchrunJob`` running ``torch_job.py --mode ours`` on the bench's Python, a fresh master port per start.

    Attributes:
      python: the job's Python (torch 2.15.0).
      job_args: ``torch_job.py`` flags.
    """

    python: str = sys.executable
    job_args: list[str] = dataclasses.field(default_factory=list)

    def train_command(self, pod: Pod) -> list[str]:
        return torchrun(
            self.python,
            self.pods.index(pod),
            self.jax_port,
            "ours",
            pod.target,
            [*self.job_args, "--job-name", self.job],
        )

    def train_env(self) -> dict[str, str]:
        return job_env()

    def start_training(self) -> None:
        self.jax_port = free_port("127.0.0.1")
        super().start_training()


@dataclasses.dataclass(frozen=True)
class Backups:
    """Our backup tier: where the agents back up to, and how often.

    Attributes:
      url: the agents' ``--backup`` (a prefix of the object store's bucket).
      stores: the object store: node ``i``'s agent reaches it through front ``i`` (``STORAGE_EMULATOR_HOST``).
      subnet: the agents' loopback hosts (``<subnet>.<i+1>``).
      every: backup-interval-steps.
    """

    url: str
    stores: StoreFronts
    subnet: str
    every: int

    def env(self, node: int) -> dict[str, str]:
        """Node ``node``'s agent's environment (google-auth would look for the GCE metadata server otherwise: from a
        loopback host's address no packet gets there)."""
        return {"STORAGE_EMULATOR_HOST": self.stores.url(node), "NO_GCE_CHECK": "true"}


class OurSetup:
    """Ours: a coordinator and two node agents (blocks b0, b1), one replica per step; node 1 is lost and replaced.
    With ``backups``, the agents back up to the object store, each from its loopback host."""

    def __init__(
        self, python: str, workdir: str, job_args: list[str], async_save: bool = False, backups: Backups | None = None
    ):
        self.python, self.workdir, self.job_args = (
            python,
            workdir,
            [
                *job_args,
                *(["--async-save"] if async_save else []),
                *(["--backup-every", str(backups.every)] if backups else []),
            ],
        )
        self.name = OURS_ASYNC if async_save else OURS
        self.backups = backups

    def available(self) -> str:
        """Empty when the job's Python can import our client, else why not."""
        probe = subprocess.run(
            [self.python, "-c", "import mtc_torch; mtc_torch.CheckpointManager"],
            check=False,
            env=job_env(),
            capture_output=True,
            text=True,
        )
        return "" if probe.returncode == 0 else probe.stderr.strip().splitlines()[-1]

    def newest_replicated_step(self, cluster: LocalCluster, job: BenchTorchrunJob) -> int:
        """The newest step every node holds on both nodes (its own and a replica), or -1."""
        status = cluster.coordinator.status(job.job)["jobs"]
        held = status[0]["held"] if status else {}
        if len(held) < NODES:
            return -1
        return max(
            set.intersection(*({int(s) for s, nodes in steps.items() if len(nodes) >= 2} for steps in held.values())),
            default=-1,
        )

    def run(self) -> Run:
        run = Run()
        backups = self.backups
        cluster = LocalCluster(
            os.path.join(self.workdir, "cluster"),
            listen_address,
            replicas=1,
            **({"backup": backups.url, "agent_wrapper": network.AS_HOST, "subnet": backups.subnet} if backups else {}),
        )
        job = None
        try:

            def add_node(index: int, block: str):
                if backups:
                    cluster.env = backups.env(index)
                return cluster.add_node(index, block=block)

            cluster.coordinator.start()
            agents = [add_node(n, block=f"b{n}") for n in range(NODES)]
            job = BenchTorchrunJob(
                "torchbench",
                agents,
                os.path.join(self.workdir, "job"),
                [],
                slices=1,
                size="2Gi",
                nproc_per_node=PROCS,
                python=self.python,
                job_args=[*self.job_args, "--steps", str(target(0)), "--save-every", str(SAVE_EVERY)],
            )
            job.create_pods()
            job.start_training()

            def processes() -> list:
                return [pod.process for pod in job.pods]

            for loss in range(NODE_LOSSES):
                logs = [pod.log_path for pod in job.pods]
                wait_trained(run, processes(), logs, target(loss), "ours")
                before = events(logs[0])
                if loss == 0:
                    measure(run, before)
                wait_for(
                    lambda: self.newest_replicated_step(cluster, job) >= target(loss),
                    processes(),
                    logs,
                    f"ours: step {target(loss)} replicated",
                )
                cluster.lose_node(job.agents[1])
                job.agents[1] = add_node(NODES + loss, block="b1")
                job.delete_pods()
                recreated_at = time.time()
                job.create_pods()
                job.job_args[job.job_args.index("--steps") + 1] = str(target(loss + 1))
                job.start_training()
                logs = [pod.log_path for pod in job.pods]
                wait_for(
                    lambda: any(e["event"] == "step" for e in events(logs[0])),
                    processes(),
                    logs,
                    "ours: the first step after the node loss",
                )
                check_restore(run, before, events(logs[0]), recreated_at)
                restore = cluster.coordinator.status(job.job)["jobs"][0]["restore"]
                run.sources.append(f"step {restore['step']} from {dict(sorted(restore['sources'].items()))}")
        finally:
            if job is not None:
                job.kill_training()
            cluster.stop()
        return run


class Baseline:
    name = "no checkpointing"

    def __init__(self, python: str, workdir: str, job_args: list[str]):
        self.python, self.workdir, self.job_args = python, workdir, job_args

    def run(self) -> Run:
        port = free_port("127.0.0.1")
        logs = [os.path.join(self.workdir, "logs", f"node-{n}.jsonl") for n in range(NODES)]
        args = [*self.job_args, "--steps", str(STEPS)]
        processes = [start(torchrun(self.python, n, port, "none", "", args), logs[n]) for n in range(NODES)]
        try:
            wait_for(lambda: all(p.poll() == 0 for p in processes), processes, logs, "no checkpointing: training done")
        finally:
            for p in processes:
                kill(p)
        run = Run()
        measure(run, events(logs[0]))
        return run


def state_bytes_per_host(width: int, layers: int) -> float:
    """The job's checkpoint bytes per node: fp32 weights and biases of ``layers`` Linear(width, width) and AdamW's
    two moments of each, sharded by FSDP over the NODES nodes."""
    return 3 * 4 * layers * (width * width + width) / NODES


def modeled(run: Run, step0: float, bytes_per_host: float, rates: goodput_model.Rates) -> float:
    """The setup's goodput in the checkpoint-interval model (``goodput_model``) at the seed's TARGET_BYTES per host and
    a failure every MTBF_S: its measured blocking per save (median saving step minus ``step0``) and node-loss restore,
    plus the extra bytes copied out at ``rates.copy`` and read back from a peer at the slower of ``rates.restore`` and
    NEAR_BW (every setup here saves and restores locally or from a peer)."""
    measured = goodput_model.Costs(
        blocking=max(statistics.median(run.step_s) - step0, 0.0), restart=statistics.median(run.restore_s)
    )
    costs = goodput_model.scaled(measured, bytes_per_host, TARGET_BYTES, rates.copy, min(rates.restore, NEAR_BW))
    return goodput_model.goodput(costs, MTBF_S)


def gpu_rates(path: str | None) -> dict[str, goodput_model.Rates]:
    """Each setup's rates: measured by ``torch_gpu`` (its JSON lines at ``path``) where it has the setup's rows, else
    the model's assumed ones."""
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    rates = {}
    for name, setup in GPU_SETUP.items():
        try:
            rates[name] = goodput_model.torch_gpu_rates(lines, setup)
        except ValueError as error:
            print(f"note: {name}: the model assumes its rates: {path}: {error}")
    return rates


def report(base: Run, results: dict[str, Run], bytes_per_host: float, measured: dict[str, goodput_model.Rates]) -> None:
    step0, mean0 = statistics.median(base.step_s), statistics.mean(base.all_s)
    rates = {name: measured.get(name, goodput_model.ASSUMED) for name in results}
    print(
        f"{'setup':<24}{'step s':>8}{'save s':>8}{'ratio':>7}{'all steps':>11}{'restore s':>11}{'model':>7}  restored step, bit-identical"
    )
    print(f"{'no checkpointing':<24}{step0:>8.3f}{'':>8}{1.0:>7.2f}{1.0:>11.2f}{'':>11}  ({len(base.step_s)} steps)")
    for name, run in results.items():
        if run.note:
            print(f"{name:<24}  not measured: {run.note}")
            continue
        step, save = statistics.median(run.step_s), statistics.median(run.save_s)
        print(
            f"{name:<24}{step:>8.3f}{save:>8.3f}{step / step0:>7.2f}{statistics.mean(run.all_s) / mean0:>11.2f}"
            f"{statistics.median(run.restore_s):>11.1f}{modeled(run, step0, bytes_per_host, rates[name]):>7.3f}  {run.restored_steps}, "
            f"{'yes' if all(run.bit_identical) else 'NO ' + str(run.bit_identical)} ({len(run.step_s)} saves)"
        )
        print(
            f"{'':<24}  restores {' '.join(f'{r:.1f}' for r in run.restore_s)} s = recreation -> process started "
            f"{' '.join(f'{r:.1f}' for r in run.launch_s)} s + started -> loaded {' '.join(f'{r:.1f}' for r in run.load_s)} s "
            f"+ the first step; node 1 restored: {run.sources[0]}"
        )
    for name, run in results.items():
        for line in run.exits:
            print(f"note: {name}: {line}")
    for name, rate in rates.items():
        print(
            f"model rates: {name}: copy out {rate.copy / 1e9:.0f} GB/s, read back {min(rate.restore, NEAR_BW) / 1e9:.0f} GB/s "
            f"per host ({rate.source})"
        )
    nvrx, ours = results.get(NVRX), results.get(OURS)
    if nvrx and ours and not nvrx.note and not ours.note:
        blocking = statistics.median(ours.step_s) <= statistics.median(nvrx.step_s)
        restore = statistics.median(ours.restore_s) <= statistics.median(nvrx.restore_s)
        model = modeled(ours, step0, bytes_per_host, rates[OURS]) >= modeled(nvrx, step0, bytes_per_host, rates[NVRX])
        print(
            f"goal ours <= NVRx (ours with save, NVRx sync save): blocking per save {'met' if blocking else 'MISSED'}, "
            f"node-loss restore {'met' if restore else 'MISSED'}; goodput in the model ours >= NVRx {'met' if model else 'MISSED'}"
        )
    else:
        print("goal ours <= NVRx: not measured (a setup did not run)")
    print(
        f"NVRx ran with the {SHIM}. step s: median train + save of the saving steps after step {WARMUP_STEPS} "
        f"(a save every {SAVE_EVERY}); ratio: that against the median step without checkpointing (blocking per save); "
        f"all steps: mean step time of every step after {WARMUP_STEPS} against no checkpointing (with what the "
        f"background work takes from training); restore s: median over {NODE_LOSSES} node losses of pod recreation -> first step after node 1's "
        f"storage was wiped. model: {goodput_model.FORMULA} (every setup here saves locally: no upload bounds τ), a failure every {MTBF_S / 60:.0f} min, δ and R measured plus the extra bytes from "
        f"{bytes_per_host / 2**20:.0f} MiB to {TARGET_BYTES / 1e9:.2f} GB per node at the model rates above "
        f"(from a peer no faster than {NEAR_BW / 1e9:.0f} GB/s). {NODES} nodes x {PROCS} processes, gloo on CPU; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python", required=True, help="the Python of the job (torch 2.15.0, NVRx 0.7.0): .venv-nvrx/bin/python"
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--gpu-results",
        default=goodput_model.GPU_RESULTS,
        help="torch_gpu's JSON lines (--out): the model takes each setup's measured "
        "copy and restore rates from them instead of the assumed ones ('': assume; default: the H200 run in "
        "docs/results)",
    )
    parser.add_argument(
        "--setups", default="nvrx,ours,ours-async", help="which to run besides no checkpointing (default: all)"
    )
    args = parser.parse_args()
    setups = set(args.setups.split(","))
    job_args = ["--width", str(args.width), "--layers", str(args.layers)]
    if not can_mount_tmpfs():
        print("note: not root: NVRx and the agents keep their files on disk, not tmpfs", file=sys.stderr)
    results: dict[str, Run] = {}
    backed: dict[str, list[int]] = {}
    bytes_per_host = state_bytes_per_host(args.width, args.layers)
    # Our backup tier's store as a real one is to this job's bytes: the goodput bench's realistic links, to the store
    # only (NVRx replicates over its own process group, which no link here shapes; neither is ours' peer tier).
    store_link = dataclasses.replace(Regime.realistic(bytes_per_host), near=None)
    with scratch_dir("mtc-bench-torch-") as (workdir, cleanup):
        base = Baseline(args.python, os.path.join(workdir, "none"), job_args).run()
        if "nvrx" in setups:
            results[NVRX] = NVRxSetup(args.python, os.path.join(workdir, "nvrx"), job_args).run()
        hosts = [f"{network.run_subnet()}.{i + 1}" for i in range(NODES + NODE_LOSSES)]  # the nodes, then each new one
        stores = StoreFronts(require_tool("fake-gcs-server"), os.path.join(workdir, "object-store"), len(hosts))
        cleanup.callback(stores.stop)
        stores.start().admin.client().create_bucket("backups")
        cleanup.enter_context(network.loopback_hosts(hosts))
        # No shorter than a node's upload: its state at the store link, in steps without checkpointing.
        every = math.ceil(store_link.upload_seconds(bytes_per_host) / statistics.median(base.step_s))
        for async_save in [a for a, name in ((False, "ours"), (True, "ours-async")) if name in setups]:
            backups = Backups(f"gs://backups/ours-{async_save}", stores, network.run_subnet(), every)
            ours = OurSetup(args.python, os.path.join(workdir, f"ours-{async_save}"), job_args, async_save, backups)
            missing = ours.available()
            with store_link.links(stores.ports, hosts):
                results[ours.name] = (
                    Run(note=f"our client is not importable here ({missing})") if missing else ours.run()
                )
            listed = stores.admin.client().list_blobs("backups", prefix=f"ours-{async_save}/")
            backed[ours.name] = sorted(
                int(b.name.split("/")[-2].split("-")[0]) for b in listed if b.name.endswith("/COMMIT")
            )
    print(
        f"ours' backup tier: fake-gcs-server, a backup every {every} steps (a node's upload at the link below); "
        f"steps backed up (complete): {'; '.join(f'{name} {steps}' for name, steps in backed.items())}; "
        f"{store_link.describe(bytes_per_host)}"
    )
    report(base, results, bytes_per_host, gpu_rates(args.gpu_results))


if __name__ == "__main__":
    main()
