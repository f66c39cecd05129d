"""The example JobSets a user copies work as written: the trainer is given its job name, the ramdisk is sized by
the sizing rule that applies to the job's shape (``space.shards_needed``, the rule the agent itself checks), the
pod's memory limit holds the ramdisk, and the comments say what the README says. Files only."""

import re
from pathlib import Path

import pytest
import yaml

from csi_driver.quantity import parse_quantity
from replicator.local_tier import space
from tests.helpers import REPO

# Every example manifest a user may apply: the repository's JobSets (examples/maxtext/jobset.yaml is a link to
# manifests/example-jobset.yaml, checked under both names).
EXAMPLES = sorted(
    {
        *REPO.glob("manifests/example-*.yaml"),
        *REPO.glob("examples/**/*.yaml"),
        *REPO.glob("charts/*/examples/**/*.yaml"),
    }
)
# The sizing line each example's volume comment shows: "ramdisk = <shards> x <shard> x <1 + margin> = ... -> <size>".
_SIZING = re.compile(r"ramdisk = (?P<shards>\d+) x (?P<shard>\w+) x (?P<factor>[\d.]+) = [\d.]+\w+ -> (?P<size>\w+)")
# The memory line of the container's comment: "Here: <process> for the process + <ramdisk> ramdisk
# [+ <staging> pinned staging] = <limit>".
_MEMORY = re.compile(
    r"Here: (?P<process>\w+) for the process \+ (?P<ramdisk>\w+) ramdisk"
    r"(?: \+ (?P<staging>\w+) pinned staging)? = (?P<limit>\w+)"
)
# What the README says of rank 0's address under the coordinator's --kube (the chart's and the base's default).
README_RANK0 = "rank 0's address from its pod IP"


def _jobset(path: Path) -> dict:
    (jobset,) = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d and d["kind"] == "JobSet"]
    return jobset


def _pod(jobset: dict) -> dict:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]["template"]["spec"]


def _attributes(jobset: dict) -> dict:
    (volume,) = [v for v in _pod(jobset)["volumes"] if "csi" in v]
    return volume["csi"]["volumeAttributes"]


def _comments(path: Path) -> str:
    """The file's comments, joined into one text (a comment's sentences run over several lines)."""
    found = [m.group(1).strip() for m in re.finditer(r"#\s?(.*)$", path.read_text(encoding="utf-8"), re.M)]
    return " ".join(found)


def _base_replicas() -> int:
    """The node agents' ``--replicas`` in the kustomize base (the chart's ``replicas`` default is the same)."""
    daemonset = yaml.safe_load((REPO / "manifests" / "node-daemonset.yaml").read_text(encoding="utf-8"))
    (agent,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "mtc-node"]
    argv = agent.get("command", []) + agent.get("args", [])
    return int(argv[argv.index("--replicas") + 1])


def test_the_examples_are_found():
    names = {p.relative_to(REPO).as_posix() for p in EXAMPLES}
    assert {"manifests/example-jobset.yaml", "manifests/example-torchrun-jobset.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_trainer_is_given_the_job_name(path):
    jobset = _jobset(path)
    (container,) = _pod(jobset)["containers"]
    argv = container.get("command", []) + container.get("args", [])
    if _attributes(jobset).get("framework") == "pytorch.distributed":  # mtc_torch's CheckpointManager(job_name=)
        assert any(re.fullmatch(r"--job-name=\S+", a) for a in argv) or "--job-name" in argv[:-1], argv
    else:  # MaxText passes run_name to Orbax as the job's name
        assert any(re.fullmatch(r"run_name=\S+", a) for a in argv), argv


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_ramdisk_is_sized_by_the_rule_of_the_jobs_shape(path):
    attributes = _attributes(_jobset(path))
    data_parallelism = int(attributes.get("slices", "1"))  # each slice holds the same data as the others
    sizing = _SIZING.search(_comments(path))
    assert sizing, f"{path.name}: no sizing line ({_SIZING.pattern}) in the volume's comment"
    shards, shard = int(sizing["shards"]), parse_quantity(sizing["shard"])
    assert shards == space.shards_needed(data_parallelism, _base_replicas()), (
        f"{path.name}: {shards} shards, but data parallelism {data_parallelism} needs "
        f"{space.shards_needed(data_parallelism, _base_replicas())}"
    )
    assert float(sizing["factor"]) == pytest.approx(1 + space.SAVE_MARGIN)
    size = parse_quantity(attributes["size"])
    assert parse_quantity(sizing["size"]) == size, "the comment's result is the volume's size"
    assert size >= shards * shard * (1 + space.SAVE_MARGIN)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_memory_limit_holds_the_process_the_ramdisk_and_the_staging_copy(path):
    jobset = _jobset(path)
    attributes = _attributes(jobset)
    (container,) = _pod(jobset)["containers"]
    limit = parse_quantity(container["resources"]["limits"]["memory"])
    memory = _MEMORY.search(_comments(path))
    assert memory, f"{path.name}: no memory line ({_MEMORY.pattern}) in the container's comment"
    assert parse_quantity(memory["ramdisk"]) == parse_quantity(attributes["size"])
    parts = [memory["process"], memory["ramdisk"]]
    if attributes.get("framework") == "pytorch.distributed":  # mtc_torch stages each save in a pinned host copy
        sizing = _SIZING.search(_comments(path))
        assert sizing and memory["staging"] and parse_quantity(memory["staging"]) == parse_quantity(sizing["shard"])
        parts.append(memory["staging"])
    assert sum(parse_quantity(p) for p in parts) == parse_quantity(memory["limit"]) == limit
    assert parse_quantity(memory["process"]) > 0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_comments_say_how_rank_0_is_reached_as_the_readme_does(path):
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert README_RANK0 in readme, "the README changed its account of rank 0's address: review the examples"
    comments = _comments(path)
    if _attributes(_jobset(path)).get("framework", "orbax") == "orbax":  # mtc writes rank 0's address for JAX
        assert "rank 0 at its pod IP" in comments
    # The `jobset` subdomain is how rank 0 is reached only without the coordinator's --kube.
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z])", comments):
        if "subdomain" in sentence:
            assert "without --kube" in sentence.lower(), f"{path.name}: {sentence!r}"
