"""The coordinator's state machine in process at 10,000 to 100,000 nodes: memory, and the cost of a
report, a decision pass, a new incarnation and a restore, without HTTP (issue 27).

``coordinator_scale`` measures the real process over HTTPS, and at 10,000 nodes its CPU and latency
figures depend on the machine's load. This bench drives ``ClusterState`` directly, with reports
built by the node's own ``ReportSession`` and passed through the wire's encoding (the coordinator
keeps what msgspec decoded), so its figures are memory and this process's CPU time (not wall time:
a busy machine stretches them less), medians of repetitions where a figure is short. The state's
memory is walked object by object from ``ClusterState`` (``deep_size``): the simulated nodes' own
data is not in it. The nodes and their steps are ``coordinator_scale``'s: one
pod per node, ``HELD_STEPS`` Orbax-like steps of 60 files per rank, one replica each.

Layouts: ``steady``, one job of N/250 slices x 250 nodes (data parallelism = slices; ``--slices``
sets another count), or ``many``,
N/8 jobs of 8 nodes. ``--shards K`` splits the jobs over K coordinators by job (``shard_of``, as a
router in front of them would), runs each shard's state in turn and prints the largest shard's
figures: what one of K coordinator processes would hold and spend.

``python -m tests.bench.coordinator_sim --nodes 10000 [--nodes 100000] [--layout many] [--shards 4] [--by-type]``
"""

import argparse
import gc
import logging
import statistics
import sys
import time
import types
import zlib

import msgspec

from replicator.coordinator.state import ClusterState, decide_interval
from replicator.node.report_session import HeldCopy, OwnStep, ReportSession
from replicator.wire.messages import BackedUp, JobRef, JobSettings, NodeReport, PodReport, ReportReply, decode_json
from tests.bench.coordinator_scale import (
    HELD_STEPS,
    NAMESPACE,
    SLICE_NODES,
    SMALL_JOB_NODES,
    STEP_NUMBERS,
    JobSpec,
    rank_files,
)

REPEATS = 5  # a short figure is the median of this many timed batches
BATCH = 1_000  # reports per timed batch
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, logging.Logger)


class SimNode:
    """One node: its session, its pod and what it holds."""

    __slots__ = ("index", "job", "key", "listings", "own", "pod", "position", "rank", "replicas", "session")

    def __init__(self, index: int, job: JobSpec, position: int):
        self.index, self.job, self.position = index, job, position
        self.key = JobRef(NAMESPACE, job.name)
        node_id = f"node-{index:06d}"
        self.session = ReportSession(
            node_id, f"https://{node_id}.sim:8470", None, {"block": f"b{index // SLICE_NODES}"}, 1, True
        )
        self.pod: PodReport | None = None
        self.rank: int | None = None
        self.own: dict[int, dict] = {}
        self.replicas: set[HeldCopy] = set()
        self.listings: dict[JobRef, BackedUp] = {}

    @property
    def node_id(self) -> str:
        return self.session._identity[0]

    def publish(self, generation: int) -> None:
        slice_index, worker = divmod(self.position, self.job.per_slice)
        uid = f"{self.job.name}-{generation}-{self.position}"
        self.pod = PodReport(
            NAMESPACE,
            self.job.name,
            f"{self.job.name}-slice-{slice_index}-{worker}-{generation}",
            uid,
            slice_index,
            worker,
            self.job.nodes,
            self.job.slices,
            8476,
            self.job.name,
            float(generation),
        )

    def report(self) -> NodeReport:
        own = [OwnStep(HeldCopy(self.key, step, self.rank), files) for step, files in self.own.items()]
        return self.session.build([self.pod], own, self.replicas, self.listings.values(), self.pod.incarnation is None)

    def obey(self, reply: ReportReply, by_id: dict[str, "SimNode"], now: float) -> None:
        for key in reply.list_backups:
            if key not in self.listings:  # the designated lister lists the (empty) backup tier
                self.listings[key] = BackedUp(key.namespace, key.job, (), now)
        for assignment in reply.assignments:
            if assignment.pod_uid == self.pod.pod_uid and assignment.incarnation != self.pod.incarnation:
                self.pod = msgspec.structs.replace(self.pod, incarnation=assignment.incarnation, rank=assignment.rank)
                self.rank = assignment.rank
        for order in reply.replicate:
            for target in order.targets:
                by_id[target.node].replicas.add(HeldCopy(JobRef(order.namespace, order.job), order.step, order.rank))


def shard_of(key: JobRef, shards: int) -> int:
    """The coordinator shard that owns ``key`` (a stable hash of namespace/job, as a router would use)."""
    return zlib.crc32(f"{key.namespace}/{key.job}".encode()) % shards


def layout(nodes: int, kind: str, slices: int | None = None) -> list[JobSpec]:
    """The jobs: ``steady``, one job of ``slices`` slices (default N/250 of 250 nodes), or ``many``."""
    if kind == "steady":
        slices = slices or max(1, nodes // SLICE_NODES)
        return [JobSpec("steady", slices, nodes // slices)]
    return [JobSpec(f"small-{i:05d}", 1, SMALL_JOB_NODES) for i in range(nodes // SMALL_JOB_NODES)]


class Sim:
    """One coordinator's state and the nodes of its jobs, on a simulated clock."""

    def __init__(self, jobs: list[JobSpec]):
        self.state = ClusterState()
        self.jobs = jobs
        places = [(job, position) for job in jobs for position in range(job.nodes)]
        self.nodes = [SimNode(index, job, position) for index, (job, position) in enumerate(places)]
        self.by_id = {n.node_id: n for n in self.nodes}
        self.now = 1_000.0

    def send(self, node: SimNode) -> float:
        """One report through the wire's encoding; returns the seconds ``apply_report`` took."""
        report = node.report()
        decoded = decode_json(msgspec.json.encode(report), NodeReport)
        started = time.process_time()
        reply = self.state.apply_report(decoded, self.now)
        took = time.process_time() - started
        node.session.acknowledge(report, reply, self.now)
        node.obey(reply, self.by_id, self.now)
        return took

    def round(self, advance: float = 0.5) -> float:
        """Every node reports once; then the clock moves and the due passes run. Returns seconds."""
        took = sum(self.send(node) for node in self.nodes)
        self.now += advance
        started = time.process_time()
        self.state.tick(self.now)
        return took + time.process_time() - started

    def form(self, generation: int) -> float:
        """Every pod is replaced; seconds of coordinator work until every pod holds its rank (the
        publishes, the forming pass and every node's reply)."""
        for node in self.nodes:
            node.publish(generation)  # its steps stay, under the rank they were written by
        took = self.round(decide_interval(max(j.nodes for j in self.jobs)))
        took += self.round()  # the waiting nodes' replies carry their assignments
        assert all(n.pod.incarnation is not None for n in self.nodes), "every pod is assigned"
        for node in self.nodes:
            incarnation = self.state.job(node.key).incarnation.incarnation_id
            settings = decode_json(
                msgspec.json.encode(node.job.settings(node.rank)), JobSettings
            )  # as the service decodes it
            self.state.restore.settings(node.key, incarnation, node.rank, settings)
        return took

    def train(self, first_step: int) -> None:
        """Every rank commits ``HELD_STEPS`` steps; replicas land; the coordinator decides."""
        for node in self.nodes:
            node.own = {
                s: rank_files(s, node.rank, node.job.per_slice)
                for s in range(first_step, first_step + HELD_STEPS * STEP_NUMBERS, STEP_NUMBERS)
            }
        for _ in range(3):  # the checksums; the replica orders; the replicas
            self.round(1.0)

    def heartbeat_ms(self) -> float:
        """Median ms of ``apply_report`` for an unchanged heartbeat."""
        self.now += 1.0
        times = []
        for r in range(REPEATS):
            batch = self.nodes[(r * BATCH) % len(self.nodes) :][:BATCH]
            times.append(sum(self.send(n) for n in batch) / len(batch))
        return statistics.median(times) * 1e3

    def commit_ms(self) -> float:
        """Median ms of ``apply_report`` for a report of a new step (with its checksums) replacing the oldest."""
        times = []
        for r in range(REPEATS):
            batch = self.nodes[(r * BATCH) % len(self.nodes) :][:BATCH]
            total = 0.0
            for node in batch:
                newest = max(node.own)
                node.own[newest + STEP_NUMBERS] = rank_files(newest + STEP_NUMBERS, node.rank, node.job.per_slice)
                del node.own[min(node.own)]
                total += self.send(node)
            times.append(total / len(batch))
        return statistics.median(times) * 1e3

    def decide_ms(self) -> float:
        """Median ms of one decision pass of the largest job after a change (its answers kept)."""
        key = JobRef(NAMESPACE, max(self.jobs, key=lambda j: j.nodes).name)
        times = []
        for _ in range(REPEATS):
            self.state.mark_dirty([key])
            started = time.process_time()
            self.state.decide(key)
            times.append(time.process_time() - started)
        return statistics.median(times) * 1e3

    def restore(self) -> float:
        """Seconds until every rank holds its restore view (the pass deciding the ranks' settings, the
        plan and every rank's view)."""
        self.now += 1.0
        started = time.process_time()
        self.state.tick(self.now)  # the settings the ranks recorded are decided
        for node in self.nodes:
            incarnation = self.state.job(node.key).incarnation.incarnation_id
            self.state.restore.view(node.key, incarnation, node.rank, self.now)
        return time.process_time() - started


def deep_size(root) -> dict[str, tuple[int, int]]:
    """Type name -> (bytes, objects) of everything ``root`` reaches (each object once; types,
    modules and functions are not counted). The state's own memory: the simulation's is not in it."""
    seen, stack, sizes = set(), [root], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        name = type(obj).__name__
        size, count = sizes.get(name, (0, 0))
        sizes[name] = (size + sys.getsizeof(obj), count + 1)
        if isinstance(obj, msgspec.Struct):  # untracked by the collector (gc=False): no referents listed
            stack.extend(getattr(obj, field) for field in obj.__struct_fields__)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif not isinstance(obj, (str, bytes, int, float)):
            stack.extend(gc.get_referents(obj))
    return sizes


def run(nodes: int, kind: str, slices: int | None, shards: int, by_type_too: bool) -> dict:
    jobs = layout(nodes, kind, slices)
    mine = [j for j in jobs if shard_of(JobRef(NAMESPACE, j.name), shards) == 0] if shards > 1 else jobs
    sim = Sim(mine)
    figures = {"nodes": sum(j.nodes for j in mine), "jobs": len(mine), "slices": max(j.slices for j in mine)}
    sim.form(1)
    sim.train(STEP_NUMBERS)
    sim.now += 60.0  # past the start-up grace: restores plan at once
    sim.round(1.0)
    by_type = deep_size(sim.state)
    figures["state_bytes"] = sum(size for size, _ in by_type.values())
    figures["top"] = (
        sorted(((size, count, name) for name, (size, count) in by_type.items()), reverse=True)[:12]
        if by_type_too
        else []
    )
    figures["heartbeat_ms"] = sim.heartbeat_ms()
    figures["commit_ms"] = sim.commit_ms()
    figures["decide_ms"] = sim.decide_ms()
    figures["incarnation_s"] = sim.form(2)
    figures["restore_s"] = sim.restore()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, action="append", help="nodes in all (repeatable; default 10,000)")
    parser.add_argument("--layout", choices=("steady", "many"), default="steady")
    parser.add_argument("--slices", type=int, help="slices of the steady job (data parallelism; default N/250)")
    parser.add_argument(
        "--shards", type=int, default=1, help="coordinators the jobs are split over by job; figures of shard 0"
    )
    parser.add_argument("--by-type", action="store_true", help="also print the state's memory by type")
    args = parser.parse_args()
    gc.set_threshold(50_000, 50, 1_000)  # as the coordinator's service runs (GC_THRESHOLDS' young generation)
    for nodes in args.nodes or [10_000]:
        f = run(nodes, args.layout, args.slices, args.shards, args.by_type)
        per_node = f["state_bytes"] / f["nodes"]
        print(
            f"{args.layout}, {nodes:,} nodes"
            + (f" ({f['slices']} slices)" if args.layout == "steady" else "")
            + (f", shard 0 of {args.shards}: {f['nodes']:,} nodes in {f['jobs']:,} jobs" if args.shards > 1 else "")
        )
        print(f"  memory of the state: {f['state_bytes'] / 2**20:,.0f} MiB ({per_node / 1e3:.1f} KB per node)")
        print(
            f"  apply_report: unchanged heartbeat {f['heartbeat_ms']:.3f} ms, new step with checksums {f['commit_ms']:.3f} ms (median)"
        )
        print(f"  decision pass of the largest job after a change: {f['decide_ms']:.2f} ms (median)")
        print(f"  new incarnation (publishes, forming pass, every reply): {f['incarnation_s']:.2f} s")
        print(f"  restore (plan and every rank's view): {f['restore_s']:.2f} s")
        for size, count, name in f["top"]:
            print(f"    {size / 2**20:8.1f} MiB  {count:>11,} {name}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
