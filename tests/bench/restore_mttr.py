"""Restore time after a node loss, from a full replica and decoded from parity, against a restore from the job's
own ramdisks, with a real Orbax job, in the same run.

Two clusters, one after the other, each a coordinator and four real ``mtc node`` agents on 127.0.0.1-4 (2 slices x
2 nodes, tmpfs ramdisks, peer tier) running the real 4-process JAX job (``examples/train.py``) with BALLAST_MIB MiB
of state per rank (``--ballast-mib``, the same in both) and ``--data-parallelism 1``, so every rank's step needs a
copy off its node:

- full copy: ``--replicas 1`` (the default): every rank's step is replicated whole to another node.
- decoded: ``--redundancy xor:4``: the four ranks form one parity group; each node keeps its own step and a
  third of it in parity shards, and a lost rank is rebuilt from the three survivors' segments and shards
  (``replicator.parity``), about three times its bytes read from three nodes and XORed.

Each repetition, on each cluster (the same operations, in the same order):

- local: once every rank's newest saved step is protected (a replica, or its group's parity built), the training
  processes are SIGKILLed and the pods recreated; every rank restores from its own ramdisk. This is the physical
  limit: Orbax reading its own checkpoint from RAM, JAX start-up and the first step.
- node loss: the same, but node 1 dies with its ramdisk and a fresh node joins; its rank's data comes from the
  peer holding the replica (``fetch_step``, verified) or is decoded from its group (verified) before Orbax reads
  it.

All are timed from the pods' recreation to the first training step (rank 0's ``step`` event). The coordinator's
restore sources are checked: every rank ``local:`` after a local restore; after a node loss the lost rank from a
peer tier (full copy) or ``decode:parity`` (decoded), the others ``local:``. A wrong source exits 1. Goals (printed,
not the exit status): node loss from a full copy <= 1.5 x local; node loss decoded <= 2 x node loss from a full copy
(issue 41). Also printed per restore: each agent's ``mtc_restore_seconds`` (replicator.yaml consumed to the restore
marker: the staging, or the fetch or decode with its verification), the fresh node's restore log lines after a node
loss, per parity cluster the encoder's build times, and each agent's peak resident memory (``VmHWM``; the lost node's
read just before it dies): replication, parity builds and restores are the agent's heaviest work, so the chart's
memory request rests on it. Run as root: ``python -m tests.bench.restore_mttr``.
"""

import os
import re
import statistics
import sys
import time
import urllib.request
import warnings

warnings.simplefilter("ignore", FutureWarning)  # google-auth's import-time notice about grpcio versions

from prometheus_client.parser import text_string_to_metric_families

from examples.local_cluster import LocalCluster, LocalJob, NodeAgentProcess, can_mount_tmpfs, scratch_dir
from tests.bench.replication_overhead import resident_mib
from tests.helpers.ports import free_port, listen_address

NODES = 4
SLICES = 2
LOST = 1  # the index of the node that dies
BALLAST_MIB = 512
SAVE_EVERY = 4
REPETITIONS = 1
REDUNDANCY = "xor:4"
GOAL = 1.5  # node loss from a full copy / local
GOAL_DECODED = 2.0  # node loss decoded / node loss from a full copy (issue 41)
WAIT_SECONDS = 600.0
TRAIN_ARGS = [
    "--steps",
    "100000",
    "--save-interval-steps",
    str(SAVE_EVERY),
    "--backup-interval-steps",
    "100000",
    "--data-parallelism",
    "1",
    "--ballast-mib",
    str(BALLAST_MIB),
    "--step-sleep",
    "0.2",
]
# The clusters: (name, further ``mtc node`` flags, the lost rank's expected source tiers, operations per repetition).
FULL, DECODED = "full copy", "decoded"
RUNS = [
    (FULL, [], ("peer_close", "peer_distant"), ["local", "node loss"]),
    (DECODED, ["--redundancy", REDUNDANCY], ("decode",), ["local", "node loss"]),
]
# The agents' log lines worth showing after a node loss (text format: ``time LEVEL logger: message``).
RESTORE_LOGGERS = re.compile(r" (prefetch\.restore|replicator\.parity[.\w]*): ")
BUILT = re.compile(r"built (\d+) parity shard\(s\) of step (\d+).* in ([0-9.]+) s")


class WrongSource(Exception):
    """A restore staged a rank from another tier than the bench measures."""


def step_times(job: LocalJob) -> dict[int, float]:
    """step -> the time rank 0 reported it, of the current pods."""
    return {e["step"]: e["time"] for pod in job.pods for e in pod.events() if e["event"] == "step"}


def newest_protected_step(cluster: LocalCluster, job: LocalJob) -> int | None:
    """The newest step every rank holds on at least two holders, or None: its own node and a replica's, or its own
    node and ``parity`` (the coordinator lists a rank's step as held by ``parity`` once its group can rebuild it)."""
    status = cluster.coordinator.status(job.job)["jobs"]
    if not status:
        return None
    held = status[0]["held"]
    if len(held) < NODES:
        return None
    common = set.intersection(*({int(s) for s, nodes in steps.items() if len(nodes) >= 2} for steps in held.values()))
    return max(common, default=None)


def train_until_protected(cluster: LocalCluster, job: LocalJob) -> int:
    """Lets the job train until a step newer than its first one is protected for every rank; kills it; returns that
    step. Killing it at once keeps the ramdisks to about two steps and their replicas or shards."""
    start = max(step_times(job), default=0)
    try:
        job.wait(lambda: (newest_protected_step(cluster, job) or 0) > start, WAIT_SECONDS, "a protected step")
    except TimeoutError as err:
        raise TimeoutError(
            f"after step {max(step_times(job), default=0)}, steps held: {cluster.coordinator.status(job.job)['jobs']}"
        ) from err
    job.kill_training()
    return newest_protected_step(cluster, job)


def recreate(job: LocalJob) -> float:
    """Recreates the pods and starts training; returns seconds from recreation to the first step."""
    job.delete_pods()
    recreated_at = time.time()
    job.create_pods()
    job.start_training()
    job.wait(lambda: step_times(job), WAIT_SECONDS, "the first step after the restart")
    return min(step_times(job).values()) - recreated_at


def check_sources(run: str, mode: str, sources: dict[str, str], lost_tiers: tuple[str, ...]) -> None:
    """Raises ``WrongSource`` unless every rank restored from its own node, but the lost one (after a node loss)
    from one of ``lost_tiers``."""
    wrong = []
    for rank in range(NODES):
        source = sources.get(str(rank), "none")
        tiers = lost_tiers if mode == "node loss" and rank == LOST else ("local",)
        if source.split(":", 1)[0] not in tiers:
            wrong.append(f"rank {rank} from {source}, not {' or '.join(tiers)}")
    if wrong:
        raise WrongSource(f"{run}, {mode}: {'; '.join(wrong)} (sources {sources})")


def restore_seconds(agent: NodeAgentProcess) -> dict[str, tuple[int, float]]:
    """The agent's ``mtc_restore_seconds``: source -> (restores, seconds in all)."""
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    counts, sums = {}, {}
    for family in text_string_to_metric_families(text):
        if family.name != "mtc_restore_seconds":
            continue
        for s in family.samples:
            if s.name == "mtc_restore_seconds_count" and s.value:
                counts[s.labels["source"]] = counts.get(s.labels["source"], 0) + int(s.value)
            elif s.name == "mtc_restore_seconds_sum":
                sums[s.labels["source"]] = sums.get(s.labels["source"], 0.0) + s.value
    return {source: (n, sums.get(source, 0.0)) for source, n in counts.items()}


def staging_seconds(agents: list[NodeAgentProcess], before: list[dict[str, tuple[int, float]]]) -> str:
    """Each agent's restores since ``before`` (``restore_seconds`` of the same agents): node, source, seconds."""
    parts = []
    for agent, earlier in zip(agents, before, strict=True):
        for source, (n, seconds) in sorted(restore_seconds(agent).items()):
            n0, seconds0 = earlier.get(source, (0, 0.0))
            if n > n0:
                parts.append(f"{agent.node_id} {source} {seconds - seconds0:.2f}")
    return ", ".join(parts) or "none"


def log_lines(agent: NodeAgentProcess, pattern: re.Pattern) -> list[str]:
    try:
        with open(agent.log_path, encoding="utf-8", errors="replace") as log:
            return [line.rstrip() for line in log if pattern.search(line)]
    except FileNotFoundError:
        return []


def encoder_summary(agents: list[NodeAgentProcess]) -> str:
    """The parity encoder's builds on ``agents`` (live and lost): how many, and their seconds."""
    seconds = []
    for agent in agents:
        for path in (agent.log_path, agent.workdir.rstrip("/") + "-lost-agent.log"):
            try:
                with open(path, encoding="utf-8", errors="replace") as log:
                    seconds += [float(m[3]) for line in log if (m := BUILT.search(line))]
            except FileNotFoundError:
                pass
    if not seconds:
        return "no parity builds logged"
    return (
        f"{len(seconds)} parity builds logged, {statistics.median(seconds):.2f} s median, {max(seconds):.2f} s max "
        f"(each node's shards of one step from its group's {BALLAST_MIB} MiB streams)"
    )


def run_cluster(workdir: str, cleanup, run: str, agent_args: list[str], lost_tiers, modes) -> list[dict[str, float]]:
    """One cluster's repetitions: per repetition, mode -> seconds from pod recreation to the first step."""
    samples, peaks = [], {}
    cluster = LocalCluster(workdir, listen_address, replicas=1, agent_args=agent_args)
    cleanup.callback(cluster.stop)
    job = LocalJob(
        "mttr",
        list(cluster.start(NODES).agents),
        os.path.join(workdir, "job"),
        TRAIN_ARGS,
        slices=SLICES,
        size="4Gi",
        jax_port=free_port("0.0.0.0"),
    )
    cleanup.callback(job.kill_training)
    job.create_pods()
    job.start_training()
    for rep in range(REPETITIONS):
        sample = {}
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            step = train_until_protected(cluster, job)
            if mode == "node loss":
                peaks[f"{job.agents[LOST].node_id} (lost)"] = resident_mib(job.agents[LOST])[1]
                cluster.lose_node(job.agents[LOST])
                job.agents[LOST] = cluster.add_node(len(cluster.agents), block=f"b{LOST // 2}")
            before = [restore_seconds(agent) for agent in job.agents]
            sample[mode] = recreate(job)
            restore = cluster.coordinator.status(job.job)["jobs"][0]["restore"]
            sources = dict(sorted(restore["sources"].items()))
            print(
                f"{run}, rep {rep} {mode}: step {restore['step']} (protected {step}) restored in {sample[mode]:.1f} s, "
                f"sources {sources}",
                flush=True,
            )
            print(f"  agents' mtc_restore_seconds (node, source, s): {staging_seconds(job.agents, before)}")
            if mode == "node loss":
                fresh = job.agents[LOST]
                for line in log_lines(fresh, RESTORE_LOGGERS):
                    print(f"  {fresh.node_id}: {line}")
            check_sources(run, mode, restore["sources"], lost_tiers)
        samples.append(sample)
    if agent_args:
        print(f"  {run}: {encoder_summary(cluster.agents)}", flush=True)
    peaks.update({agent.node_id: resident_mib(agent)[1] for agent in job.agents})
    print(f"  {run}: agents' peak resident memory (VmHWM, MiB): {', '.join(f'{n} {m:.0f}' for n, m in peaks.items())}")
    job.kill_training()
    cluster.stop()
    return samples


def main() -> int:
    if not can_mount_tmpfs():
        print("note: not root, agents use the dir backend (ramdisks on disk)", file=sys.stderr)
    samples: dict[str, list[dict[str, float]]] = {}
    started = time.monotonic()
    with scratch_dir("mtc-bench-mttr-") as (workdir, cleanup):
        for run, agent_args, lost_tiers, modes in RUNS:
            try:
                samples[run] = run_cluster(
                    os.path.join(workdir, run.replace(" ", "-")), cleanup, run, agent_args, lost_tiers, modes
                )
            except WrongSource as err:
                print(f"FAILED: the wrong restore source: {err}", file=sys.stderr, flush=True)
                return 1

    full, decoded = samples[FULL], samples[DECODED]
    local = statistics.median(s["local"] for s in full)
    local_decoded = statistics.median(s["local"] for s in decoded)
    lost = statistics.median(s["node loss"] for s in full)
    rebuilt = statistics.median(s["node loss"] for s in decoded)
    ratio = statistics.median(s["node loss"] / s["local"] for s in full)
    # The clusters run one after the other: repetition i of one against repetition i of the other.
    ratio_decoded = statistics.median(d["node loss"] / f["node loss"] for d, f in zip(decoded, full, strict=True))
    print(f"{'restore to the first step':<34}{'s':>7}")
    print(f"{'local (own ramdisks)':<34}{local:>7.1f}")
    print(f"{f'local, {REDUNDANCY} cluster':<34}{local_decoded:>7.1f}")
    print(f"{'node loss, from a full copy':<34}{lost:>7.1f}")
    print(f"{f'node loss, decoded ({REDUNDANCY})':<34}{rebuilt:>7.1f}")
    print(f"{'operation':<16}{'node loss s':>12}{'local s':>9}{'ratio':>8}  goal")
    print(
        f"{'restore to step':<16}{lost:>12.1f}{local:>9.1f}{ratio:>8.2f}  <= {GOAL} {'PASS' if ratio <= GOAL else 'BELOW'}"
    )
    print(f"{'node loss':<16}{'decoded s':>12}{'full s':>9}{'ratio':>8}  goal")
    print(
        f"{'restore to step':<16}{rebuilt:>12.1f}{lost:>9.1f}{ratio_decoded:>8.2f}  <= {GOAL_DECODED} "
        f"{'met' if ratio_decoded <= GOAL_DECODED else 'MISSED'}"
    )
    print(
        f"medians of {REPETITIONS} repetitions; seconds from pod recreation to the first training step; "
        f"{NODES} JAX processes, {BALLAST_MIB} MiB per rank in both clusters; node loss restores one rank from a "
        f"peer's full replica (--replicas 1) or decodes it from its parity group (--redundancy {REDUNDANCY}). "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, {time.monotonic() - started:.0f} s "
        "in all."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
