"""The docs' figures agree with the benches' raw output: every figure a page marks with ``<!-- figure: ID -->`` is
the one ``docs/results/figures.yaml`` derives from its results file (or, for the few runs whose raw output was not
kept, the one text it records), so a doc repeating a stale figure fails here. Files only."""

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

FIGURES_FILE = REPO / "docs" / "results" / "figures.yaml"
# The pages a user or an operator reads, where figures are repeated.
PAGES = sorted(
    {
        REPO / "README.md",
        REPO / "CHANGELOG.md",
        *REPO.glob("docs/**/*.md"),
        *REPO.glob("charts/*/README.md"),
        *REPO.glob("examples/**/README.md"),
    }
)
# Figure ids are lower case, so a page that names the marker itself (`<!-- figure: ID -->`) holds none.
MARKER = re.compile(r"<!-- figure: (?P<id>[a-z0-9.-]+) -->")


def _figures() -> dict[str, dict]:
    return yaml.safe_load(FIGURES_FILE.read_text(encoding="utf-8"))["figures"]


def _field(record: dict, path: str):
    for key in path.split("."):
        record = record[key]
    return record


def expected_text(figure: dict, root: Path = REPO) -> str:
    """What a page must show for ``figure``: its ``format`` filled from its results file, or its ``text``.

    Raises:
      AssertionError: the results file does not hold the figure once (no match, or several JSON lines).
    """
    if "file" not in figure:
        return figure["text"]
    content = (root / figure["file"]).read_text(encoding="utf-8")
    if "find" in figure:
        match = re.search(figure["find"], content)
        assert match, f"{figure['file']}: nothing matches {figure['find']!r}"
        return figure["format"].format(*match.groups())
    records = [json.loads(line) for line in content.splitlines() if line.strip()]
    chosen = [r for r in records if all(r.get(k) == v for k, v in figure["select"].items())]
    assert len(chosen) == 1, f"{figure['file']}: {len(chosen)} lines match {figure['select']}"
    return figure["format"].format(_field(chosen[0], figure["field"]))


def marked(pages: list[Path], root: Path = REPO) -> list[tuple[str, str, str]]:
    """Each marker of the pages: (where, figure id, the line's text before it, bold marks and spaces stripped)."""
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in MARKER.finditer(line):
                before = MARKER.sub("", line[: m.start()]).rstrip().rstrip("*").rstrip()
                found.append((f"{page.relative_to(root)}:{number}", m.group("id"), before))
    return found


def shows(before: str, text: str) -> bool:
    """True when ``before`` ends with ``text`` as a whole figure (``1117 KB`` does not show ``117 KB``)."""
    return re.search(r"(?<![\d.,])" + re.escape(text) + "$", before) is not None


def disagreements(pages: list[Path], figures: dict[str, dict], root: Path = REPO) -> list[str]:
    """One line per marker whose figure is unknown or whose text is not the figure's."""
    problems = []
    for where, figure_id, before in marked(pages, root):
        if figure_id not in figures:
            problems.append(f"{where}: no figure {figure_id!r} in {FIGURES_FILE.name}")
        elif not shows(before, text := expected_text(figures[figure_id], root)):
            problems.append(f"{where}: {figure_id} should read {text!r}: ...{before[-40:]!r}")
    return problems


def test_every_marked_figure_is_its_results_files():
    assert disagreements(PAGES, _figures()) == []


def test_every_figure_is_shown_somewhere_and_every_run_is_described():
    figures = _figures()
    shown = {figure_id for _, figure_id, _ in marked(PAGES)}
    assert sorted(set(figures) - shown) == [], "a figure no page shows: remove it or mark where it is shown"
    runs = yaml.safe_load(FIGURES_FILE.read_text(encoding="utf-8"))["runs"]
    for figure_id, figure in figures.items():
        assert ("file" in figure) != ("source" in figure), figure_id
        if "file" in figure:
            assert figure["file"] in runs, f"{figure_id}: describe {figure['file']} under runs:"
            assert re.fullmatch(r"docs/results/\d{4}-\d{2}-\d{2}-\w+-[\w.]+\.(jsonl|txt)", figure["file"])


@pytest.mark.parametrize(
    ("shown", "ok"),
    [("memory **117 KB**", True), ("memory 118 KB", False), ("memory 1117 KB", False), ("memory", False)],
)
def test_a_figure_that_differs_from_its_results_file_is_found(tmp_path, shown, ok):
    (tmp_path / "run.txt").write_text("steady: coordinator memory  195 MiB resident: 117 KB per node\n")
    page = tmp_path / "page.md"
    page.write_text(f"At 1,000 nodes, {shown}<!-- figure: kb --> per node.\n")
    figures = {"kb": {"file": "run.txt", "find": r"memory .*: (\d+) KB per node", "format": "{} KB"}}
    assert (disagreements([page], figures, tmp_path) == []) == ok


def test_a_json_lines_figure_is_read_from_the_one_line_selected(tmp_path):
    (tmp_path / "run.jsonl").write_text(
        '{"kind": "ratio", "what": "a", "value": 11.215}\n{"kind": "ratio", "what": "b", "value": 3.0}\n'
    )
    figure = {"file": "run.jsonl", "select": {"kind": "ratio", "what": "a"}, "field": "value", "format": "{:.1f}"}
    assert expected_text(figure, tmp_path) == "11.2"
    with pytest.raises(AssertionError, match="2 lines match"):
        expected_text({**figure, "select": {"kind": "ratio"}}, tmp_path)
