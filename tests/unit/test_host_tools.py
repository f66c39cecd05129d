"""Every program the tests, their helpers and the product code they run start by name is one that make installs
or checks (``tests/helpers/host_tools.py``), for the targets that run it: a new ``subprocess.run(["foo", ...])``
fails here, not on a fresh machine after 18 minutes.

The scan reads the source (ast): a call of a launcher (``subprocess.run``, ``Popen``, ...), or of a function that
passes one of its parameters on to a launcher as the command (``network._run``, ``mounts._run(*argv)``, the
Kubernetes helpers' ``_Process``), or of anything handed a launcher (``ExitStack.callback(subprocess.run, argv)``),
names a program when its command is a list whose first item is a string literal, or a literal itself. Programs
found by name (``shutil.which``, ``find_tool``, ``require_tool``) count too. Commands built from variables
(``sys.executable``, a path ``find_tool`` returned) name nothing here.
"""

import ast
import re
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.host_tools import BASE, GO_TOOLS, SUITES

SCANNED = ("tests", "examples", "csi_driver", "replicator", "prefetch", "mtc_torch")
K8S = ("tests/k8s", "tests/helpers/kube")
DEPLOY = (
    "tests/deploy",
    *(f"tests/helpers/kube/{m}.py" for m in ("deploy_node", "deployment", "pod_network", "training_jobset")),
)
"""make e2e-deploy's code: the Kubernetes suites and its own."""
"""Run by ``make e2e-k8s`` only, which adds the ``etcd`` and ``node`` suites to ``local``."""

LAUNCHERS = {f"subprocess.{f}" for f in ("run", "Popen", "call", "check_call", "check_output")} | {
    "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
    "os.system",
    "os.popen",
    "os.execvp",
    "os.execlp",
}
"""Their first argument is the command: a list (or tuple) of arguments, a shell line, or the program itself."""
FINDERS = {"shutil.which", "tests.helpers.tools.find_tool", "tests.helpers.tools.require_tool"}


class _Module:
    """One source file: its calls, its functions, and what its names stand for (``from X import Y``: ``Y`` is ``X.Y``)."""

    def __init__(self, path: Path, base: Path):
        self.path = str(path.relative_to(base))
        self.name = ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")
        nodes = list(ast.walk(ast.parse(path.read_text(), self.path)))
        self.calls = [n for n in nodes if isinstance(n, ast.Call)]
        self.imports = {}
        for node in nodes:
            if isinstance(node, ast.Import):
                self.imports.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.ImportFrom):
                self.imports.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        classes = {id(f): c.name for c in nodes if isinstance(c, ast.ClassDef) for f in c.body}
        # (qualified name, positional parameters but self, the * parameter, the calls in its body) of each
        # function; a class's __init__ goes by the class's name, as its callers name it.
        self.functions = []
        for function in (n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            params = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
            name = classes[id(function)] if function.name == "__init__" and id(function) in classes else function.name
            self.functions.append(
                (
                    f"{self.name}.{name}",
                    params[1:] if params[:1] in (["self"], ["cls"]) else params,
                    function.args.vararg and function.args.vararg.arg,
                    [n for n in ast.walk(function) if isinstance(n, ast.Call)],
                )
            )

    def qualified(self, node: ast.expr) -> str | None:
        """What ``node`` names: ``subprocess.run``, ``tests.helpers.network._run``; a name or method of this
        module's own (``_run``, ``self.ctr``) as ``<this module>.<name>``."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id, f"{self.name}.{node.id}")
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in self.imports:
                return f"{self.imports[node.value.id]}.{node.attr}"
            return f"{self.name}.{node.attr}"
        return None


def _commands(module: _Module, call: ast.Call, launchers: dict[str, set[int]]) -> list[ast.expr]:
    """The commands ``call`` starts: its own launcher's, and that of a launcher it is handed with its arguments
    (``callback(subprocess.run, argv)``, ``partial(_run, "mount")``)."""
    found = [call.args[i] for i in launchers.get(module.qualified(call.func), ()) if i < len(call.args)]
    for at, arg in enumerate(call.args):
        found += [
            call.args[at + 1 + i] for i in launchers.get(module.qualified(arg), ()) if at + 1 + i < len(call.args)
        ]
    return found


def _program(command: ast.expr) -> str | None:
    if isinstance(command, (ast.List, ast.Tuple)) and command.elts:
        command = command.elts[0]
    if isinstance(command, ast.Constant) and isinstance(command.value, str) and command.value.strip():
        return command.value.split()[0]
    return None


def _wrappers(module: _Module, launchers: dict[str, set[int]]) -> dict[str, set[int]]:
    """This module's functions (and classes) that start the command one of their parameters holds: {qualified
    name: the positions of those parameters}."""
    found = {}
    for name, params, vararg, calls in module.functions:
        for command in (c for call in calls for c in _commands(module, call, launchers)):
            if isinstance(command, ast.Name) and command.id in (*params, vararg):
                position = params.index(command.id) if command.id in params else len(params)  # *argv: its first
                found.setdefault(name, set()).add(position)
    return found


def scan(roots: list[Path], base: Path = REPO) -> list[tuple[str, int, str]]:
    """(file relative to ``base``, line, program) for every program the code under ``roots`` names."""
    modules = [_Module(path, base) for root in roots for path in sorted(root.rglob("*.py"))]
    launchers = {name: {0} for name in LAUNCHERS}
    while True:  # until no new wrapper: a wrapper of a wrapper is one too
        found = [(name, positions) for m in modules for name, positions in _wrappers(m, launchers).items()]
        if all(positions <= launchers.get(name, set()) for name, positions in found):
            break
        for name, positions in found:
            launchers.setdefault(name, set()).update(positions)
    named = []
    for module in modules:
        for call in module.calls:
            commands = _commands(module, call, launchers)
            if module.qualified(call.func) in FINDERS:
                commands += call.args[:1]
            named += [(module.path, call.lineno, p) for p in map(_program, commands) if p]
    return named


def _allowed(relative: str) -> set[str]:
    if relative.startswith(DEPLOY):
        suites = ["local", "etcd", "node", "deploy"]
    else:
        suites = ["local", "etcd", "node"] if relative.startswith(K8S) else ["local"]
    return {*BASE, *GO_TOOLS, *(tool for suite in suites for tool in SUITES[suite])}


def test_every_program_the_tests_start_is_installed_or_checked_by_the_targets_that_run_them():
    named = scan([REPO / root for root in SCANNED])
    unlisted = [f"{path}:{line}: {program}" for path, line, program in named if program not in _allowed(path)]
    assert not unlisted, f"started by name, but in no set of tests/helpers/host_tools.py for this code: {unlisted}"
    assert {"iptables", "iptables-restore", "tc", "ss", "mount", "openssl", "ctr"} <= {p for _, _, p in named}


@pytest.mark.parametrize(
    ("source", "program"),
    [
        ('import subprocess\nsubprocess.run(["nsenter", "-t", "1"])\n', "nsenter"),
        (
            "import subprocess\ndef _run(command, check=True):\n    return subprocess.run(command, check=check)\n"
            'def sh(*argv):\n    _run(argv)\nsh("unshare", "-n")\n',
            "unshare",
        ),
        (
            'import contextlib, subprocess\nwith contextlib.ExitStack() as s:\n    s.callback(subprocess.run, ["losetup", "-d"])\n',
            "losetup",
        ),
        (
            "import subprocess\nclass P:\n    def __init__(self, name, command):\n        self.p = subprocess.Popen(command)\n"
            'P("x", ["nft", "list"])\n',
            "nft",
        ),
        ('import shutil\nshutil.which("tcpdump")\n', "tcpdump"),
    ],
)
def test_the_scan_finds_a_program_started_directly_through_wrappers_or_handed_on(tmp_path, source, program):
    (tmp_path / "helper.py").write_text(source)
    assert [program] == [p for _, _, p in scan([tmp_path], tmp_path)]
    assert program not in _allowed("tests/helpers/helper.py")


def test_go_tools_are_the_ones_the_makefile_builds():
    makefile = (REPO / "Makefile").read_text()
    assert not [tool for tool in GO_TOOLS if not re.search(rf"(?<![\w-]){tool}(?![\w-])", makefile)]
