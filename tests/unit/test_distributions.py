"""The two distributions' metadata, read from their pyproject.toml files: the agent (``mtc-checkpointing``) and the
PyTorch client (``mtc-torch``, clients/torch), which a training image installs beside its own torch."""

import ast
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
AGENT = tomllib.loads((REPO / "pyproject.toml").read_text())
CLIENT = tomllib.loads((REPO / "clients" / "torch" / "pyproject.toml").read_text())
# Import name -> distribution, for the client's third-party imports.
DISTRIBUTION_OF = {"torch": "torch", "yaml": "PyYAML", "numpy": "numpy", "torchtitan": "torchtitan"}


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name: r for line in names}


def client_imports() -> set[str]:
    """The top-level modules mtc_torch imports that are neither its own nor the standard library's."""
    found = set()
    for source in (REPO / "mtc_torch").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"mtc_torch", "__future__"}


def test_the_client_requires_only_what_mtc_torch_imports_and_numpy_for_dcp_over_gloo():
    required = requirements(CLIENT["project"]["dependencies"])
    extras = requirements(CLIENT["project"]["optional-dependencies"]["torchtitan"])
    assert client_imports() == {"torch", "yaml", "torchtitan"}
    assert {DISTRIBUTION_OF[m] for m in client_imports()} == set(required) - {"numpy"} | set(extras)
    assert set(required) == {"torch", "numpy", "PyYAML"}


def test_the_client_accepts_torch_from_the_gpu_figures_version_on_without_an_upper_bound():
    torch = requirements(CLIENT["project"]["dependencies"])["torch"]
    assert str(torch.specifier) == ">=2.11"
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.15.0")
    assert not torch.specifier.contains("2.10.0")


def test_the_two_sides_of_the_protocol_and_the_chart_are_released_together_on_the_same_pythons():
    assert CLIENT["project"]["version"] == AGENT["project"]["version"]
    chart = yaml.safe_load((REPO / "charts" / "mtc" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == AGENT["project"]["version"]
    assert CLIENT["project"]["requires-python"] == AGENT["project"]["requires-python"] == ">=3.11"
    # `mtc export` beside the agent: the extra is the client of the same release.
    assert AGENT["project"]["optional-dependencies"]["torch"] == [f"mtc-torch=={AGENT['project']['version']}"]


def test_mtc_torch_is_the_clients_alone_and_built_from_the_repositorys_package():
    assert not any(p.startswith("mtc_torch") for p in AGENT["tool"]["setuptools"]["packages"]["find"]["include"])
    setuptools = CLIENT["tool"]["setuptools"]
    assert setuptools["packages"] == ["mtc_torch"]
    assert (REPO / "clients" / "torch" / setuptools["package-dir"]["mtc_torch"]).resolve() == REPO / "mtc_torch"


def test_the_claimed_python_versions_are_those_the_makefile_tests():
    claimed = {
        c.rsplit(" :: ", 1)[1] for c in AGENT["project"]["classifiers"] if c.count("::") == 2 and "Python :: 3." in c
    }
    makefile = (REPO / "Makefile").read_text()
    assert claimed == {"3.11", "3.12", "3.13"}
    assert all(f"make test-py{v}" in makefile for v in claimed - {"3.11"})
