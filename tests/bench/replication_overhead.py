"""Replication overhead: training step time with the peer tier replicating against without it, in the same run.

Each run is a fresh cluster on loopback: a coordinator and four real ``mtc node`` agents on
127.0.0.1-4 (2 slices x 2 nodes, topology blocks b0 and b1, tmpfs ramdisks), and the real 4-process
JAX job (``examples/train.py``) with ``--data-parallelism 1``, so no rank has a data-parallel peer
and the coordinator orders every node to push its newest committed step to another node:

- without: agents without ``--peer-token-file``: the peer tier is off, nothing is replicated;
- with: agents with ``--peer-token-file`` and ``--replicas 1``: every commit is pushed to a peer
  in the other block (``mtc_replicated_steps_total``, counted on every agent, shows it happened).

train.py's model is tiny (a checkpoint is a few KiB per rank), so the job saves every step
(``--save-interval-steps 1``): replication then runs all the time, and what it costs the job is
the agents' CPU work (checksums, HTTP, the coordinator's extra orders) competing with training on
the same cores, plus any delay it adds to Orbax's commit. Without replication is the physical
limit: the same job on the same agents, which only record commits. The goal is with/without <= 1.05.

Step time is the difference between consecutive ``{"event": "step", "time": ...}`` lines of rank 0
(each covers one train step and its save), without the first WARMUP_STEPS (compilation, the first
saves). Each repetition runs the job once each way, alternating which goes first; with/without is
the median of the per-repetition ratios of median step times.
Run as root: ``python -m tests.bench.replication_overhead``.
"""

import os
import re
import socket
import statistics
import sys
import time
import urllib.request
import warnings

import psutil

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from examples.local_cluster import LocalCluster, LocalJob, NodeAgentProcess, can_mount_tmpfs, scratch_dir  # noqa: E402

NODES = 4
SLICES = 2
STEPS = 60
WARMUP_STEPS = 5
REPETITIONS = 3
GOAL = 1.05
RUN_TIMEOUT = 120.0
TRAIN_ARGS = ["--steps", str(STEPS), "--save-interval-steps", "1", "--backup-interval-steps", "1000",
              "--data-parallelism", "1"]  # fmt: skip
PUSH_LOG = re.compile(r"replicated step (\d+) of rank (\d+) to (\S+) in ([\d.]+) s \((\d+) bytes\)")
METRIC = re.compile(r'^mtc_replicated_steps_total\{result="(\w+)"\} ([\d.e+]+)$', re.M)


def free_port(host: str) -> int:
    """A port the kernel reports free on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def cpu_seconds(processes) -> float:
    """User + system CPU seconds the processes (agents, coordinator) used so far."""
    return sum(sum(psutil.Process(p.process.pid).cpu_times()[:2]) for p in processes)


def run_job(replication: bool) -> dict:
    """One fresh cluster and one training run; returns rank 0's step times and what was replicated."""
    with scratch_dir("mtc-bench-repl-") as (workdir, cleanup):
        cluster = LocalCluster(workdir, lambda host: f"{host}:{free_port(host)}", replicas=1, peer_tier=replication)
        cleanup.callback(cluster.stop)
        cluster.start(NODES)
        agents, coordinator = cluster.agents, cluster.coordinator

        job = LocalJob("bench", agents, os.path.join(workdir, "job"), TRAIN_ARGS, slices=SLICES, jax_port=free_port("0.0.0.0"))
        cleanup.callback(job.kill_training)
        job.create_pods()
        started = time.monotonic()
        job.start_training()
        job.wait_done(RUN_TIMEOUT)
        wall = time.monotonic() - started
        counts = replicated(agents)
        service_cpu = cpu_seconds([*agents, coordinator])

        rank0 = next(p for p in job.pods if any(e["event"] == "init" and e["rank"] == 0 for e in p.events()))
        times = [e["time"] for e in rank0.events() if e["event"] == "step"]
        saved = sum(1 for e in rank0.events() if e["event"] == "saved")
        if len(times) != STEPS:
            raise RuntimeError(f"rank 0 reported {len(times)} steps, expected {STEPS}")
        deltas = [b - a for a, b in zip(times[WARMUP_STEPS:], times[WARMUP_STEPS + 1:])]
        step_dir = os.path.join(rank0.target, str(STEPS))
        files = sum(len(names) for _, _, names in os.walk(step_dir))
        return {"step": statistics.median(deltas), "wall": wall, "saved": saved, "replicated": counts,
                "pushes": pushes(agents), "cpu": service_cpu, "files": files}  # fmt: skip


def report(samples: list[dict[str, dict]]) -> None:
    without = statistics.median(s["without"]["step"] for s in samples)
    with_ = statistics.median(s["with"]["step"] for s in samples)
    ratio = statistics.median(s["with"]["step"] / s["without"]["step"] for s in samples)
    verdict = "PASS" if ratio <= GOAL else "BELOW"
    print(f"{'rep':<5}{'without s/step':>16}{'with s/step':>13}{'with/without':>14}{'pushed ok':>11}{'failed':>8}"
          f"{'services CPU s without':>24}{'with':>7}")  # fmt: skip
    for rep, s in enumerate(samples):
        w, wo = s["with"], s["without"]
        print(f"{rep:<5}{wo['step']:>16.4f}{w['step']:>13.4f}{w['step'] / wo['step']:>14.3f}"
              f"{w['replicated']['ok']:>11}{w['replicated']['failed']:>8}{wo['cpu']:>24.1f}{w['cpu']:>7.1f}")  # fmt: skip
    print()
    print(f"{'operation':<16}{'with s':>10}{'without s':>11}{'with/without':>14}  goal")
    print(f"{'training step':<16}{with_:>10.4f}{without:>11.4f}{ratio:>14.3f}  <= {GOAL} {verdict}")
    all_pushes = [p for s in samples for p in s["with"]["pushes"]]
    rank_steps = {(rep, p[0], p[1]) for rep, s in enumerate(samples) for p in s["with"]["pushes"]}
    committed = sum(s["with"]["saved"] * NODES for s in samples)
    leaked = sum(sum(s["without"]["replicated"].values()) for s in samples)
    push_note = (f"{len(all_pushes)} pushes of {len(rank_steps)} of the {committed} committed rank-steps, median "
                 f"{statistics.median(p[2] for p in all_pushes) * 1000:.0f} ms and "
                 f"{statistics.median(p[3] for p in all_pushes) / 1024:.1f} KiB in {samples[0]['with']['files']} files each"
                 if all_pushes else "NO pushes")  # fmt: skip
    print(f"medians of {REPETITIONS} repetitions (each run: median of {STEPS - WARMUP_STEPS - 1} step intervals after "
          f"{WARMUP_STEPS} warm-up steps); with/without is the median of per-repetition ratios. "
          f"{NODES} JAX processes ({SLICES} slices), --data-parallelism 1, a save every step. "
          f"With replication: {push_note}; without: {leaked} pushes. Services CPU s: agents + coordinator, "
          f"user + system, over the run. Job wall time median with {statistics.median(s['with']['wall'] for s in samples):.1f} s, "
          f"without {statistics.median(s['without']['wall'] for s in samples):.1f} s; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the end.")  # fmt: skip


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
