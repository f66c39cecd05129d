"""Every module of a layered package is named in the import contracts (``[tool.importlinter]`` in
``pyproject.toml``): import-linter constrains nothing it is not told about, so a new module left out of its
package's ``layers`` contract could import anything. A module is covered when it or a package above it is named
in a layer; a contract with ``containers`` names the container's children, one without names packages whose
siblings must then be named too.
"""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _children(package: str, root: Path) -> set[str]:
    """The dotted names of a package's modules and sub-packages, one level down."""
    folder = root.joinpath(*package.split("."))
    return {
        f"{package}.{path.stem}"
        for path in folder.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    }


def _named(layer: str, container: str | None) -> set[str]:
    """The modules a layer names (``a | b``: independent, ``a : b``: not), made absolute."""
    names = {part.strip() for part in layer.replace("|", ":").split(":") if part.strip()}
    return {f"{container}.{name}" if container else name for name in names}


def uncovered(pyproject: Path = ROOT / "pyproject.toml", root: Path = ROOT) -> dict[str, list[str]]:
    """Per ``layers`` contract, the modules of its packages that no layer names (nor a package above them)."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    missing = {}
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        containers = contract.get("containers") or [None]
        named = {name for container in containers for layer in contract["layers"] for name in _named(layer, container)}
        # A container's children; without containers, the siblings of every named module below a root package.
        packages = set(containers) - {None} or {name.rpartition(".")[0] for name in named} - {""}
        left = sorted(
            module
            for package in packages
            for module in _children(package, root)
            if not any(module == name or module.startswith(name + ".") for name in named)
        )
        if left:
            missing[contract["name"]] = left
    return missing


def test_every_module_of_a_layered_package_is_named_in_its_layers():
    assert uncovered() == {}


def test_a_module_left_out_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "new.py", "sub/__init__.py", "sub/deep.py"):
        (package / name).write_text("")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[[tool.importlinter.contracts]]\nname = "pkg"\ntype = "layers"\ncontainers = ["pkg"]\nlayers = ["a | sub", "b"]\n'
        '[[tool.importlinter.contracts]]\nname = "top"\ntype = "layers"\nlayers = ["pkg.a", "pkg.sub"]\n'
    )
    assert uncovered(pyproject, tmp_path) == {"pkg": ["pkg.new"], "top": ["pkg.b", "pkg.new"]}
