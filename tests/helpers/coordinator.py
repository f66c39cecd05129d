"""A two-node data-parallelism-1 job in the coordinator's state, driven by hand-built reports (no HTTP)."""

from replicator.coordinator.state import ClusterState
from replicator.wire.messages import HeldStep, JobRef, JobSettings, NodeReport, PodReport
from tests.helpers.reports import node_report, pod_report

KEY = JobRef("default", "run")
NAMES = (KEY.namespace, KEY.job)  # a message's namespace and job fields
OWN = {0: {"state/a": (10, "00000001")}, 1: {"state/b": (10, "00000002")}}
SETTINGS = JobSettings((), 1, None, 1)


def pod(index, incarnation=None, rank=None) -> PodReport:
    return pod_report(KEY, 0, index, f"uid{index}", incarnation, rank, SETTINGS if rank is not None else None, nodes=2)


def report(node, url, pods=(), held=(), has_backup=False) -> NodeReport:
    topology = {"block": node}
    return node_report(node, pods, held, url=url, pod_address="127.0.0.1", topology=topology, has_backup=has_backup)


def held_by(node, rank_of):
    """Node ``node``'s own step 5 and its replica of the other rank (node a's does not match)."""
    mine, theirs = rank_of[node], rank_of["b" if node == "a" else "a"]
    replica = {path: (size, "0000bad0") for path, (size, _) in OWN[theirs].items()} if node == "a" else OWN[theirs]
    return [HeldStep(*NAMES, 5, mine, OWN[mine]), HeldStep(*NAMES, 5, theirs, replica, replica=True)]


def running_job(state: ClusterState, now=0.0, has_backup=False):
    """Nodes a and b run the two ranks of a DP=1 job; each holds its own step 5 and the other's
    replica. Node a's replica does not match what the rank's own node (b) reported."""
    state.apply_report(report("a", "http://a", [pod(0)]), now)
    incarnation = state.apply_report(report("b", "http://b", [pod(1)]), now).assignments[0].incarnation
    rank_of_pod = state.job(KEY).incarnation.rank_of_pod
    rank_of = {"a": rank_of_pod["uid0"], "b": rank_of_pod["uid1"]}
    for node in ("a", "b"):
        state.restore.settings(KEY, incarnation, rank_of[node], SETTINGS)
    for index, node in enumerate(("a", "b")):
        state.apply_report(
            report(
                node, f"http://{node}", [pod(index, incarnation, rank_of[node])], held_by(node, rank_of), has_backup
            ),
            now,
        )
    return incarnation, rank_of
