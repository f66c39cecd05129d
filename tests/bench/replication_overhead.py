"""Replication overhead: training step time with the peer tier replicating against without it, in the same run.

Each run is a fresh cluster on loopback: a coordinator and four real ``mtc node`` agents on
127.0.0.1-4 (2 slices x 2 nodes, topology blocks b0 and b1, tmpfs ramdisks), and the real 4-process
JAX job (``examples/train.py``) with ``--data-parallelism 1``, so no rank has a data-parallel peer
and the coordinator orders every node to push the replication round's step (the newest step every rank
holds, ``replicator/coordinator/copies/replicas.py``) to another node:

- without: agents without ``--peer-token-file``: the peer tier is off, nothing is replicated;
- with: agents with ``--peer-token-file`` and ``--replicas 1``: every commit is pushed to a peer
  in the other block (``mtc_replicated_steps_total``, counted on every agent, shows it happened).

Every rank carries BALLAST_MIB MiB of state (``train.py --ballast-mib``), so each save writes
that much per rank and replication pushes it to a peer; the job saves every SAVE_EVERY steps. What
replication costs the job is the agents' CPU work (checksums, HTTP, receiving and verifying the
replica) competing with training on the same cores, plus any delay it adds to Orbax's commit. Every
agent runs with ``--background-cpu CAP`` and the bench reports each agent's CPU share over the
run against the cap. Without replication is the physical limit: the same job on the same agents,
which only checksum commits. The goal is with/without <= 1.02 (on a real cluster each node has its
own cores; here four nodes and four training processes share this machine's).

Step time is rank 0's wall time per step: the mean difference between consecutive
``{"event": "step", "time": ...}`` lines after the first WARMUP_STEPS (compilation, the first
saves), so the saves and whatever replication slows are in it. Each repetition runs the job once
each way, alternating which goes first; with/without is the median of the per-repetition ratios.
Run as root: ``python -m tests.bench.replication_overhead``.
"""

import os
import re
import statistics
import sys
import threading
import time
import urllib.request
import warnings

import psutil

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, LocalJob, NodeAgentProcess, can_mount_tmpfs, scratch_dir
from tests.helpers.ports import free_port, listen_address

NODES = 4
SLICES = 2
STEPS = 32
WARMUP_STEPS = 8
SAVE_EVERY = 8
BALLAST_MIB = 256
CAP = 0.5  # --background-cpu of every agent, CPUs
REPETITIONS = 2
GOAL = 1.02
RUN_TIMEOUT = 300.0
SAMPLE_SECONDS, WINDOW_SECONDS = 0.5, 2.0  # the cap is checked over every 2 s window of every agent
TRAIN_ARGS = [
    "--steps",
    str(STEPS),
    "--save-interval-steps",
    str(SAVE_EVERY),
    "--backup-interval-steps",
    "1000",
    "--data-parallelism",
    "1",
    "--ballast-mib",
    str(BALLAST_MIB),
]
PUSH_LOG = re.compile(r"replicated step (\d+) of rank (\d+) to (\S+) in ([\d.]+) s \((\d+) bytes\)")
METRIC = re.compile(r'^mtc_replicated_steps_total\{result="(\w+)"\} ([\d.e+]+)$', re.M)


def replicated(agents: list[NodeAgentProcess]) -> dict[str, int]:
    """``mtc_replicated_steps_total`` by result, summed over the agents."""
    totals = {"ok": 0, "failed": 0}
    for agent in agents:
        with urllib.request.urlopen(agent.url + "/metrics", timeout=5) as response:
            for result, value in METRIC.findall(response.read().decode()):
                totals[result] = totals.get(result, 0) + int(float(value))
    return totals


def pushes(agents: list[NodeAgentProcess]) -> list[tuple[int, int, float, int]]:
    """(step, rank, seconds, bytes) of every push the agents logged."""
    found = []
    for agent in agents:
        with open(agent.log_path, encoding="utf-8", errors="replace") as log:
            found += [(int(s), int(r), float(t), int(b)) for s, r, _, t, b in PUSH_LOG.findall(log.read())]
    return found


def cpu_seconds(process) -> float:
    """User + system CPU seconds a service process (agent, coordinator) used so far."""
    return sum(psutil.Process(process.process.pid).cpu_times()[:2])


def resident_mib(process) -> tuple[float, float]:
    """(now, peak) resident memory of a service process, MiB: ``VmRSS`` and ``VmHWM``. Neither counts the
    tmpfs pages it wrote (a replica, a restore), which its memory cgroup is charged for as well."""
    with open(f"/proc/{process.process.pid}/status", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f)
    kib = [int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")]
    return kib[0] / 1024, kib[1] / 1024


class CpuSampler:
    """Samples the agents' CPU seconds every SAMPLE_SECONDS on a thread, to find their busiest windows."""

    def __init__(self, agents: list[NodeAgentProcess]):
        self._agents = agents
        self._stop = threading.Event()
        self.samples: list[tuple[float, list[float]]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.samples.append((time.monotonic(), [cpu_seconds(a) for a in self._agents]))

    def stop(self) -> list[float]:
        """Each agent's highest CPU share (CPUs) over any WINDOW_SECONDS of the run."""
        self._stop.set()
        self._thread.join()
        per = round(WINDOW_SECONDS / SAMPLE_SECONDS)
        windows = list(zip(self.samples, self.samples[per:]))
        return [
            max(((b[1][i] - a[1][i]) / (b[0] - a[0]) for a, b in windows), default=0.0)
            for i in range(len(self._agents))
        ]


def run_job(replication: bool) -> dict:
    """One fresh cluster and one training run; returns rank 0's step times and what was replicated."""
    with scratch_dir("mtc-bench-repl-") as (workdir, cleanup):
        cluster = LocalCluster(
            workdir, listen_address, replicas=1, peer_tier=replication, agent_args=["--background-cpu", str(CAP)]
        )
        cleanup.callback(cluster.stop)
        cluster.start(NODES)
        agents, coordinator = cluster.agents, cluster.coordinator

        job = LocalJob(
            "bench",
            agents,
            os.path.join(workdir, "job"),
            TRAIN_ARGS,
            slices=SLICES,
            size="3Gi",
            jax_port=free_port("0.0.0.0"),
        )
        cleanup.callback(job.kill_training)
        job.create_pods()
        cpu_before = [cpu_seconds(a) for a in agents]
        sampler = CpuSampler(agents)
        started = time.monotonic()
        job.start_training()
        try:
            job.wait_done(RUN_TIMEOUT)
        finally:
            peaks = sampler.stop()
        wall = time.monotonic() - started
        counts = replicated(agents)
        agent_shares = [(cpu_seconds(a) - before) / wall for a, before in zip(agents, cpu_before)]
        service_cpu = sum(cpu_seconds(p) for p in [*agents, coordinator])

        rank0 = next(p for p in job.pods if any(e["event"] == "init" and e["rank"] == 0 for e in p.events()))
        times = [e["time"] for e in rank0.events() if e["event"] == "step"]
        saved = sum(1 for e in rank0.events() if e["event"] == "saved")
        if len(times) != STEPS:
            raise RuntimeError(f"rank 0 reported {len(times)} steps, expected {STEPS}")
        step_dir = os.path.join(rank0.target, str(STEPS))
        files = sum(len(names) for _, _, names in os.walk(step_dir))
        return {
            "step": (times[-1] - times[WARMUP_STEPS]) / (len(times) - 1 - WARMUP_STEPS),
            "wall": wall,
            "saved": saved,
            "replicated": counts,
            "pushes": pushes(agents),
            "cpu": service_cpu,
            "shares": agent_shares,
            "peaks": peaks,
            "files": files,
        }


def report(samples: list[dict[str, dict]]) -> None:
    without = statistics.median(s["without"]["step"] for s in samples)
    with_ = statistics.median(s["with"]["step"] for s in samples)
    ratio = statistics.median(s["with"]["step"] / s["without"]["step"] for s in samples)
    verdict = "PASS" if ratio <= GOAL else "BELOW"
    print(
        f"{'rep':<5}{'without s/step':>16}{'with s/step':>13}{'with/without':>14}{'pushed ok':>11}{'failed':>8}"
        f"{'services CPU s without':>24}{'with':>7}{'agent CPUs with: run':>22}{f'busiest {WINDOW_SECONDS:g} s':>14}"
    )
    for rep, s in enumerate(samples):
        w, wo = s["with"], s["without"]
        print(
            f"{rep:<5}{wo['step']:>16.4f}{w['step']:>13.4f}{w['step'] / wo['step']:>14.3f}"
            f"{w['replicated']['ok']:>11}{w['replicated']['failed']:>8}{wo['cpu']:>24.1f}{w['cpu']:>7.1f}{max(w['shares']):>22.3f}{max(w['peaks']):>14.3f}"
        )
    print()
    print(f"{'operation':<16}{'with s':>10}{'without s':>11}{'with/without':>14}  goal")
    print(f"{'training step':<16}{with_:>10.4f}{without:>11.4f}{ratio:>14.3f}  <= {GOAL} {verdict}")
    shares = [share for s in samples for share in s["with"]["shares"]]
    peaks = [peak for s in samples for peak in s["with"]["peaks"]]
    held = "HOLDS" if max(peaks) <= CAP * 1.1 else "EXCEEDED"
    print(
        f"{'agent CPU share':<16} busiest {WINDOW_SECONDS:g} s of any agent {max(peaks):.3f} CPUs (median agent {statistics.median(peaks):.3f}); "
        f"over the run max {max(shares):.3f}; cap --background-cpu {CAP}: {held} (limit cap x 1.1)"
    )
    all_pushes = [p for s in samples for p in s["with"]["pushes"]]
    rank_steps = {(rep, p[0], p[1]) for rep, s in enumerate(samples) for p in s["with"]["pushes"]}
    committed = sum(s["with"]["saved"] * NODES for s in samples)
    leaked = sum(sum(s["without"]["replicated"].values()) for s in samples)
    push_note = (
        f"{len(all_pushes)} pushes of {len(rank_steps)} of the {committed} committed rank-steps, median "
        f"{statistics.median(p[2] for p in all_pushes) * 1000:.0f} ms and "
        f"{statistics.median(p[3] for p in all_pushes) / 2**20:.1f} MiB in {samples[0]['with']['files']} files each"
        if all_pushes
        else "NO pushes"
    )
    print(
        f"medians of {REPETITIONS} repetitions (each run: mean of {STEPS - WARMUP_STEPS - 1} step intervals after "
        f"{WARMUP_STEPS} warm-up steps); with/without is the median of per-repetition ratios. "
        f"{NODES} JAX processes ({SLICES} slices), --data-parallelism 1, {BALLAST_MIB} MiB per rank, a save every {SAVE_EVERY} steps. "
        f"With replication: {push_note}; without: {leaked} pushes. Services CPU s: agents + coordinator, "
        f"user + system, over the run. Job wall time median with {statistics.median(s['with']['wall'] for s in samples):.1f} s, "
        f"without {statistics.median(s['without']['wall'] for s in samples):.1f} s; {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the end."
    )


def main() -> None:
    if not can_mount_tmpfs():
        print("note: not root, agents use the dir backend (ramdisks on disk)", file=sys.stderr)
    samples = []
    for rep in range(REPETITIONS):
        order = ["without", "with"] if rep % 2 == 0 else ["with", "without"]
        samples.append({mode: run_job(mode == "with") for mode in order})
    report(samples)


if __name__ == "__main__":
    main()
