"""Node agents and the coordinator driven by hand, as kubelet and a training pod would (no training
process): publish, the Orbax protocol files, ``/metrics``."""

import json
import os
import urllib.request
from pathlib import Path

from csi_driver import kubelet
from replicator.local_tier.frameworks.orbax import JAX_INIT_INFO_FILE, REPLICATOR_FILE, RESTORE_SUFFIX
from tests.helpers.polling import wait_until
from tests.helpers.steps import commit_step


def scrape(url: str, context=None) -> str:
    """The ``/metrics`` page of the agent or coordinator at ``url``."""
    with urllib.request.urlopen(url + "/metrics", context=context) as response:
        return response.read().decode()


def rank_of(target) -> int:
    """The rank the agent assigned to the pod whose volume is at ``target`` (``jax-init-info.txt``)."""
    with open(os.path.join(target, JAX_INIT_INFO_FILE), encoding="utf-8") as f:
        return int(f.read().split("\n")[0])


def replicator_yaml(job: str, rank: int, nodes: int, **settings) -> str:
    """What Orbax writes as ``replicator.yaml``; ``settings`` add or replace fields, ``_`` for ``-``
    (``backup_interval_steps=1``)."""
    fields = {
        "job-name": job,
        "framework": "orbax",
        "assume-data-parallelism": 1,
        "node-rank": rank,
        "nodes": nodes,
        "peer-ranks": [],
        **{name.replace("_", "-"): value for name, value in settings.items()},
    }
    return "".join(f"{name}: {value}\n" for name, value in fields.items())


def start_fresh(targets, job: str, nodes: int, timeout: float = 30.0, take_markers: bool = False, **settings) -> None:
    """Takes the pods at ``targets`` through the protocol to a fresh start, as Orbax does: waits for
    their ranks, writes ``replicator.yaml`` (``settings`` as in ``replicator_yaml``) and waits for the
    restore markers; ``take_markers`` removes them, as Orbax does before it trains."""
    wait_until(
        lambda: all(os.path.exists(os.path.join(t, JAX_INIT_INFO_FILE)) for t in targets),
        timeout,
        f"{job}: ranks assigned",
    )
    for target in targets:
        with open(os.path.join(target, REPLICATOR_FILE + ".tmp"), "w", encoding="utf-8") as f:
            f.write(replicator_yaml(job, rank_of(target), nodes, **settings))
        os.replace(os.path.join(target, REPLICATOR_FILE + ".tmp"), os.path.join(target, REPLICATOR_FILE))

    def markers(target) -> list[str]:
        return [name for name in os.listdir(target) if name.endswith(RESTORE_SUFFIX)]

    wait_until(lambda: all(markers(t) for t in targets), timeout, f"{job}: restore markers")
    for target in targets if take_markers else ():
        for marker in markers(target):
            os.unlink(os.path.join(target, marker))


def job_status(coordinator, job: str) -> dict:
    """The job's row of the coordinator's ``GET /v1/status`` as plain JSON, whatever release the
    coordinator runs, or {} before it knows the job."""
    with urllib.request.urlopen(
        f"{coordinator.url}/v1/status?job={job}", context=coordinator.ssl_context(), timeout=5
    ) as response:
        jobs = json.load(response)["jobs"]
    return jobs[0] if jobs else {}


def publish_pods(agents, pods_dir, job: str, suffix: str) -> list[Path]:
    """Publishes pod ``<job>-slice-0-<i>-<suffix>`` on agent ``i`` (one slice, a node each, 16 MiB), as
    the kubelet does for a (re)created JobSet; returns their targets."""
    targets = []
    for index, agent in enumerate(agents):
        target = Path(pods_dir) / f"{suffix}-{index}" / "mount"
        kubelet.publish(
            agent.endpoint,
            str(target),
            f"{job}-slice-0-{index}-{suffix}",
            attributes={"nodes": str(len(agents)), "size": "16Mi"},
        )
        targets.append(target)
    return targets


def save_until_safe(coordinator, targets, job: str, step: int, holders: list[str], timeout: float = 60.0) -> None:
    """Every pod at ``targets`` commits ``step`` of job ``job`` (as Orbax does); waits until each rank's
    copies of it are on exactly the nodes ``holders`` and it is the job's safe step."""
    for target in targets:
        commit_step(target, step, {"state/data": os.urandom(4096), "_CHECKPOINT_METADATA": b"{}"})

    def held() -> dict:
        return {
            int(rank): sorted(steps.get(str(step), ()))
            for rank, steps in job_status(coordinator, f"{job}-slice").get("held", {}).items()
        }

    wait_until(
        lambda: held() == {rank: sorted(holders) for rank in range(len(targets))},
        timeout,
        lambda: f"step {step} held by {holders}: {held()}",
    )
    wait_until(
        lambda: job_status(coordinator, f"{job}-slice").get("safe_step") == step,
        timeout,
        lambda: f"step {step} safe: {job_status(coordinator, f'{job}-slice')}",
    )
