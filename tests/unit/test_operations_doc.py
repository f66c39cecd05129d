"""docs/operations.md keeps its promises: every flag of every ``mtc`` command appears in that command's
section (the kubelet stand-ins' in docs/development.md), and every metric the code exports appears in the
metrics table. The flags come from the argparse builders and the metrics from the exposition the services
serve, so a flag or metric added without a line in the docs fails here. Files and imports only."""

import argparse
import functools
import re
import subprocess
import sys

import pytest

from replicator.cli import parser
from tests.helpers import REPO
from tests.helpers.markdown import prose_lines

OPERATIONS = REPO / "docs" / "operations.md"
DEVELOPMENT = REPO / "docs" / "development.md"
# Each command, the page and the heading of the section that documents its flags.
SECTIONS = {
    "node": (OPERATIONS, "The node agent"),
    "coordinator": (OPERATIONS, "The coordinator"),
    "status": (OPERATIONS, "Status"),
    "gc": (OPERATIONS, "Releasing ramdisks"),
    "restore-from": (OPERATIONS, "Roll back"),
    "export": (OPERATIONS, "Export a PyTorch step"),
    "doctor": (OPERATIONS, "Doctor"),
    "publish": (DEVELOPMENT, "The kubelet stand-in"),
    "unpublish": (DEVELOPMENT, "The kubelet stand-in"),
}
# Every command takes these; "Every command" documents them once.
_COMMON = {"--help", "--log-level", "--log-format"}
# The packages whose modules register metrics when imported (mtc_torch exports none: it runs in the job).
_PACKAGES = ("csi_driver", "replicator", "prefetch")


def _commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def section(path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level: subsections and code
    blocks included (a usage block lists the flags), a ``#`` line inside a code block taken for no heading."""
    lines, prose = path.read_text(encoding="utf-8").splitlines(), prose_lines(path)
    start = next(i for i, line in enumerate(prose) if re.fullmatch(rf"(#+) {re.escape(heading)}\s*", line))
    level = len(prose[start]) - len(prose[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(prose)) if re.match(rf"#{{1,{level}}} ", prose[i])), len(prose))
    return "\n".join(lines[start + 1 : end])


def mentioned(flag: str, text: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


def test_every_command_has_a_documented_section():
    assert set(_commands()) == set(SECTIONS), "a new command needs its section in SECTIONS and in the docs"


@pytest.mark.parametrize("command", sorted(SECTIONS))
def test_every_flag_of_the_command_is_in_its_section(command):
    path, heading = SECTIONS[command]
    text = section(path, heading)
    flags = {o for a in _commands()[command]._actions for o in a.option_strings if o.startswith("--")} - _COMMON
    assert flags, f"mtc {command} has no flags?"
    missing = sorted(f for f in flags if not mentioned(f, text))
    assert missing == [], f"{path.name}, section {heading!r}, lacks these flags of mtc {command}"


def test_the_common_flags_are_in_every_command():
    text = section(OPERATIONS, "Every command")
    assert all(mentioned(flag, text) for flag in _COMMON - {"--help"})


# Run in a fresh interpreter, as the agent and the coordinator run: a test module may register metrics of its own
# in this process's default registry (test_in_flight.py does), which no service exports.
_EXPOSITION = """
import importlib, pkgutil, sys
for package in sys.argv[1:]:
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
from replicator.coordinator.api.cluster_gauges import exposition
from replicator.coordinator.state import ClusterState
sys.stdout.write(exposition(ClusterState()).decode())
"""


@functools.cache
def exported_metrics() -> frozenset[str]:
    """The ``mtc_*`` names the node agent's and the coordinator's ``/metrics`` can serve: every module's
    registered metrics (all imported, as the processes import theirs) and the coordinator's computed gauges."""
    done = subprocess.run(
        [sys.executable, "-c", _EXPOSITION, *_PACKAGES], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # A counter's TYPE line names it with ``_total``; ``_created`` are prometheus_client's own companions.
    names = set(re.findall(r"^# TYPE (mtc_\w+) \w+$", done.stdout, re.M))
    return frozenset(n for n in names if not n.endswith("_created"))


def metrics_table() -> set[str]:
    table = [line for line in section(OPERATIONS, "Metrics").splitlines() if line.startswith("| `")]
    return {name for line in table for name in re.findall(r"`(mtc_\w+)", line.split("|")[1])}


def test_every_exported_metric_is_in_the_metrics_table():
    exported = exported_metrics()
    assert len(exported) > 40, f"the scan found too few metrics: {sorted(exported)}"
    assert sorted(exported - metrics_table()) == []


def test_the_metrics_table_names_only_exported_metrics():
    assert sorted(metrics_table() - exported_metrics()) == []


def test_section_reads_up_to_the_next_heading_of_its_level():
    text = section(OPERATIONS, "Status")
    assert "### From outside the cluster" in text and "mtc status --coordinator URL" in text
    assert "## Releasing ramdisks" not in text
