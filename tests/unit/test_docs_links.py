"""The README and docs/ stay linked: every relative link resolves, every #anchor names a heading, every module
path the pages name exists, and the README stays a front door (at most 300 lines). Fast: files only, no processes.
"""

import re
from pathlib import Path

import pytest

from tests.helpers.markdown import CODE_SPAN, anchors, prose_lines

ROOT = Path(__file__).resolve().parent
while not (ROOT / "pyproject.toml").exists():  # tests/ may gain subdirectories; the repository root holds pyproject
    ROOT = ROOT.parent

README_MAX_LINES = 300
# What a user or an operator reads: the front door, the docs, and the READMEs next to the code they describe.
PAGES = sorted(
    {
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("charts/*/README.md"),
        *ROOT.glob("examples/**/README.md"),
    }
)

_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A code span that names a file or directory of this repository (its first segment is a top-level entry).
_TOP_LEVEL = (
    "csi_driver/",
    "replicator/",
    "prefetch/",
    "examples/",
    "manifests/",
    "charts/",
    "protos/",
    "docs/",
    "tests/",
)
_DOTTED = re.compile(r"^(csi_driver|replicator|prefetch)(\.[a-z_][a-z0-9_]*)+$")
# A line that describes a change other work brings (checked by hand at merge, then the marker goes).
_TO_CHECK = "<!-- lead: check -->"
# Orbax's file names in the pod's directory, not modules.
_NOT_MODULES = {"replicator.yaml", "replicator.errors", "replicator.failed"}
# Modules of other projects the pages cite by name (Orbax's multi-tier checkpointing).
_OTHER_PROJECTS = {"initialization.py", "replicator_checkpoint_manager.py"}


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose_lines(path), 1):
        line = CODE_SPAN.sub("", line)  # `[x](y)` inside a code span is not a link
        found += [(number, m.group("target")) for m in _LINK.finditer(line)]
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not markdown")
    return problems


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """Code spans naming a repository file (`replicator/node/loop.py`) or module (`replicator.wire.messages`) that
    does not exist. A test file is named by its base name (`test_cpu_share.py`), found anywhere under tests/; any
    other base name (`loop.py`) must name some module of the repository. Lines marked `<!-- lead: check -->`
    are skipped: they name what a change not merged yet brings."""
    problems = []
    tests = {p.name for p in (root / "tests").rglob("*.py")}
    modules = {p.name for top in _TOP_LEVEL if (root / top).is_dir() for p in (root / top).rglob("*.py")}
    for number, line in enumerate(prose_lines(path), 1):
        if _TO_CHECK in line:
            continue  # describes what a change not merged yet brings; the lead checks it and drops the marker
        for span in CODE_SPAN.findall(line):
            span = span.strip()
            if " " in span or "<" in span or "*" in span or "{" in span:
                continue  # a command, a template or a glob, not a path
            where = f"{path.relative_to(root)}:{number}: `{span}`"
            if span.startswith(_TOP_LEVEL):
                if not (root / span.split(":")[0]).exists():
                    problems.append(f"{where}: no such file or directory")
            elif re.fullmatch(r"test_[a-z0-9_]+\.py", span):
                if span not in tests:
                    problems.append(f"{where}: no such test module under tests/")
            elif re.fullmatch(r"[a-z0-9_]+\.py", span):  # a module named by its base name (`orbax.py`)
                if span not in modules and span not in _OTHER_PROJECTS:
                    problems.append(f"{where}: no module of that name in the repository")
            elif _DOTTED.match(span) and span not in _NOT_MODULES:
                parts = span.split(".")
                # A module, a package, or an attribute of one (`...orbax.clear_previous_pod`).
                if not any(
                    (root.joinpath(*parts[:n]).with_suffix(".py")).exists()
                    or (root.joinpath(*parts[:n]) / "__init__.py").exists()
                    for n in (len(parts), len(parts) - 1)
                ):
                    problems.append(f"{where}: no such module")
    return problems


def test_pages_are_found():
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert "README.md" in names and any(n.startswith("docs/") for n in names), names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_code_paths_exist(page):
    assert missing_paths(page) == []


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(ROOT / "README.md")}
    unlinked = [str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md") if p.resolve() not in linked]
    assert unlinked == []


def test_the_checker_finds_what_is_broken(tmp_path):
    """The checks themselves: a missing file, a missing anchor, a missing module are each reported; a line
    marked for the lead is not."""
    (tmp_path / "other.md").write_text("# A `code` heading, with punctuation!\n## Twice\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading-with-punctuation) [ok](other.md#twice-1) [ok](#local)\n"
        "# Local\n[gone](missing.md) [bad](other.md#nope)\n```\n[fenced](nowhere.md)\n```\n"
    )
    (tmp_path / "tests").mkdir()
    problems = broken_links(page, root=tmp_path)
    page.write_text(
        "`replicator/no_such_module.py` `replicator.wire.no_such` `test_nothing_here.py` `gone.py` `mtc node`\n"
        "`replicator/to_come.py` <!-- lead: check -->\n"
    )
    missing = missing_paths(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file",
        "other.md#nope: no heading with anchor #nope in other.md",
    ]
    assert len(missing) == 4, missing
