"""The node agent's own CPU at steady state: jobs train, nothing changes, the agent should be nearly idle.

Two real ``mtc node`` agents (tmpfs ramdisks when root) and a coordinator on loopback, as
``examples.local_cluster.LocalCluster`` starts them; the first agent is measured. JOBS two-node
jobs are published, one pod on each agent, with the kubelet stand-in, and each pod goes through
the real protocol as Orbax would drive it: its agent writes the rank the coordinator assigned
(``jax-init-info.txt``), consumes ``replicator.yaml``, writes the fresh-start marker (which the
"job" then takes), and the pod commits STEPS Orbax-like steps of FILES_PER_STEP files
(``_CHECKPOINT_METADATA``, ``state/`` with OCDBT-like data files, ``process_metadata/``) by renaming
``<step>.orbax-checkpoint-tmp`` to ``<step>``. The peer tier is off, so no step gets the replica
the job's settings want, none becomes safe to collect, and every rank holds its STEPS steps (on a
real cluster, until a replica lands; Orbax's own retention bounds them). Once the coordinator
reports every step held and the agents have settled, the measured agent's and the coordinator's
CPU seconds (psutil, user + system) are taken over WINDOWS windows of ``--window-seconds`` (>= 10,
so >= 30 s in all); the median window is printed as % of one core beside the goal (issue 9: the
agent <= 2 % of a core; the coordinator is for reference). The agent's resident memory is printed too: once
started with no job, and with the jobs after the windows (the chart's memory request rests on it).

``--profile`` runs the agent under ``tests.bench.profiled`` (cProfile in every thread, CPU time,
reset once settled) and prints where its CPU goes in the measured windows: the functions with the
most self time, and the project's own functions by cumulative time. The CPU figures of that run
are inflated by the profiler and not judged.

Exits 0 only when the goal is met (always 0 with ``--profile``). Run as root:
``python -m tests.bench.agent_idle [--window-seconds 12] [--backup] [--profile]``.
"""

import argparse
import os
import pstats
import signal
import statistics
import sys
import time

from csi_driver import kubelet
from examples.local_cluster import LocalCluster, can_mount_tmpfs, scratch_dir
from replicator.local_tier.frameworks.orbax import JAX_INIT_INFO_FILE, REPLICATOR_FILE, RESTORE_SUFFIX
from tests.bench.replication_overhead import cpu_seconds, resident_mib
from tests.helpers.agents import replicator_yaml
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address
from tests.helpers.steps import commit_step

JOBS = 3
NODES = (0, 1)  # each job has a pod on each agent; agent 0 is measured
STEPS = (100, 200, 300)
FILES_PER_STEP = 60
FILE_BYTES = 16 << 10
GOAL_PERCENT = 2.0  # of one core, the agent
WINDOWS = 3
SETTLE_SECONDS = 5.0
READY_TIMEOUT = 120.0
TOP = 12
_PROJECT_DIRS = ("/csi_driver/", "/replicator/", "/prefetch/")


def step_files() -> dict[str, int]:
    """Relative path -> size of one Orbax-like step: the commit evidence, OCDBT state, process metadata."""
    fixed = {
        "_CHECKPOINT_METADATA": 256,
        "commit_success.txt": 32,
        "state/_METADATA": 2048,
        "state/_sharding": 1024,
        "state/manifest.ocdbt": 512,
        "state/commit_success.txt": 32,
        "state/ocdbt.process_0/manifest.ocdbt": 512,
        "process_metadata/mesh_metadata.json": 256,
        "process_metadata/commit_success.txt": 32,
    }
    data = {f"state/ocdbt.process_0/d/{i:032x}": FILE_BYTES for i in range(FILES_PER_STEP - len(fixed))}
    return {**fixed, **data}


def start_jobs(cluster: LocalCluster, workdir: str) -> list[str]:
    """Publishes JOBS jobs, one pod per agent, and takes each pod through the protocol to STEPS
    held; returns the job keys."""
    pods = []
    for index in range(JOBS):
        for node, agent in zip(NODES, cluster.agents):
            name = f"idle{index}"
            target = os.path.join(workdir, "pods", f"{name}-{node}", "mount")
            kubelet.publish(
                agent.endpoint,
                target,
                f"{name}-slice-0-{node}-a",
                attributes={"nodes": str(len(NODES)), "size": "64Mi"},
            )
            pods.append((f"{name}-slice", target))
    for job, target in pods:
        init_info = os.path.join(target, JAX_INIT_INFO_FILE)
        wait_until(lambda: os.path.exists(init_info), READY_TIMEOUT, f"{job}: rank assigned")
        with open(init_info, encoding="utf-8") as f:
            rank = int(f.read().split("\n")[0])
        with open(os.path.join(target, REPLICATOR_FILE + ".tmp"), "w", encoding="utf-8") as f:
            f.write(replicator_yaml(job, rank, len(NODES), backup_interval_minutes=30))
        os.replace(os.path.join(target, REPLICATOR_FILE + ".tmp"), os.path.join(target, REPLICATOR_FILE))
    for job, target in pods:
        markers = lambda: [n for n in os.listdir(target) if n.endswith(RESTORE_SUFFIX)]  # noqa: E731
        wait_until(markers, READY_TIMEOUT, f"{job}: restore marker")
        for marker in markers():
            os.unlink(os.path.join(target, marker))  # Orbax removes the fresh-start marker and trains
        for step in STEPS:
            commit_step(target, step, {rel: os.urandom(size) for rel, size in step_files().items()})
    want = {str(rank): {str(s) for s in STEPS} for rank in range(len(NODES))}
    jobs = sorted({job for job, _ in pods})
    for job in jobs:
        held = lambda: {r: set(s) for r, s in cluster.coordinator.status(job)["jobs"][0]["held"].items()}  # noqa: E731
        wait_until(lambda: held() == want, READY_TIMEOUT, f"{job}: steps {list(STEPS)} held by every rank")
    return jobs


def measure(cluster: LocalCluster, window_seconds: float) -> list[tuple[float, float]]:
    """(agent, coordinator) CPU of each window, % of one core."""
    processes = [cluster.agents[0], cluster.coordinator]
    windows = []
    for _ in range(WINDOWS):
        before, started = [cpu_seconds(p) for p in processes], time.monotonic()
        time.sleep(window_seconds)
        wall = time.monotonic() - started
        agent, coordinator = (100 * (cpu_seconds(p) - b) / wall for p, b in zip(processes, before))
        windows.append((agent, coordinator))
    return windows


def print_profile(profile: pstats.Stats) -> None:
    stats = profile.stats  # (file, line, function) -> (calls, primitive calls, self s, cumulative s, callers)
    total = sum(tt for _, _, tt, _, _ in stats.values())

    def row(key, value) -> str:
        (filename, line, function), (_, calls, tt, ct, _) = key, value
        where = filename.split("site-packages/")[-1].replace(os.getcwd() + "/", "")
        return f"  {tt:>8.2f} {100 * tt / total:>6.1f}% {ct:>9.2f} {calls:>9}  {function} ({where}:{line})"

    print(f"\nprofile of the agent (all threads, {total:.1f} CPU s in the measured windows)")
    print(f"  {'self s':>8} {'self':>7} {'cumul s':>9} {'calls':>9}  function")
    print("  most self time:")
    for key, value in sorted(stats.items(), key=lambda item: -item[1][2])[:TOP]:
        print(row(key, value))
    print("  the project's functions by cumulative time:")
    ours = [item for item in stats.items() if any(d in item[0][0] for d in _PROJECT_DIRS)]
    for key, value in sorted(ours, key=lambda item: -item[1][3])[:TOP]:
        print(row(key, value))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window-seconds", type=float, default=12.0, help="length of each of the 3 windows (>= 10)")
    parser.add_argument("--backup", action="store_true", help="agents back up to a file:// store as well")
    parser.add_argument(
        "--profile", action="store_true", help="run the agent under cProfile and print where its CPU goes"
    )
    args = parser.parse_args()
    if args.window_seconds < 10:
        parser.error("--window-seconds must be >= 10: the goal is judged over >= 30 s")
    if not can_mount_tmpfs():
        print("note: not root, the agent uses the dir backend (ramdisks on disk)", file=sys.stderr)
    with scratch_dir("mtc-bench-idle-") as (workdir, cleanup):
        profile_path = os.path.join(workdir, "agent.pstats")
        cluster = LocalCluster(
            workdir,
            listen_address,
            peer_tier=False,
            backup=f"file://{workdir}/bucket" if args.backup else None,
            agent_wrapper=["tests.bench.profiled", profile_path] if args.profile else None,
        )
        cleanup.callback(cluster.stop)
        cluster.start(len(NODES))
        time.sleep(SETTLE_SECONDS)
        no_jobs = resident_mib(cluster.agents[0])
        jobs = start_jobs(cluster, workdir)
        time.sleep(SETTLE_SECONDS)
        if args.profile:
            cluster.agents[0].process.send_signal(signal.SIGUSR1)  # profile the steady state only
        windows = measure(cluster, args.window_seconds)
        with_jobs = resident_mib(cluster.agents[0])
        cluster.agents[0].stop()  # the profiler writes its file as the agent exits
        profile = pstats.Stats(profile_path) if args.profile else None
    agent = statistics.median(w[0] for w in windows)
    coordinator = statistics.median(w[1] for w in windows)
    met = agent <= GOAL_PERCENT
    print(
        f"node agent CPU at steady state: {JOBS} jobs ({', '.join(jobs)}) of {len(NODES)} nodes, {len(STEPS)} held steps per rank of "
        f"{FILES_PER_STEP} files, backups {'on (file://)' if args.backup else 'off'}; {WINDOWS} windows of "
        f"{args.window_seconds:g} s after {SETTLE_SECONDS:g} s settling; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'window':<8}{'agent % of a core':>19}{'coordinator %':>15}")
    for index, (a, c) in enumerate(windows):
        print(f"{index:<8}{a:>19.2f}{c:>15.2f}")
    verdict = "under the profiler: not judged" if args.profile else ("MET" if met else "MISSED")
    print(f"{'median':<8}{agent:>19.2f}{coordinator:>15.2f}   goal: agent <= {GOAL_PERCENT:g} % of a core: {verdict}")
    print(
        f"agent resident memory (VmRSS, MiB): {no_jobs[0]:.0f} started with no job, {with_jobs[0]:.0f} with the jobs; "
        f"peak (VmHWM) {with_jobs[1]:.0f}"
    )
    if profile is not None:
        print_profile(profile)
        return 0
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
