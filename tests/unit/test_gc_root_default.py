"""``mtc gc`` in the agent's container: ``--root`` defaults to ``$MTC_ROOT``, which the node DaemonSet sets, and
without either it is a one-line usage error (exit 2), never a traceback."""

import pytest

from replicator import cli
from replicator.cli import node_commands


class _NoRamdisks:
    def reap_idle(self, retention_seconds: float) -> list:
        return []


@pytest.fixture
def opened(monkeypatch) -> list[tuple[str, str]]:
    """The (root, backend) each ``open_ramdisks`` call got; it opens nothing."""
    calls: list[tuple[str, str]] = []

    def open_ramdisks(root: str, backend: str) -> _NoRamdisks:
        calls.append((root, backend))
        return _NoRamdisks()

    monkeypatch.setattr(node_commands, "open_ramdisks", open_ramdisks)
    monkeypatch.delenv("MTC_ROOT", raising=False)
    return calls


def test_gc_without_root_uses_the_agents_root_from_mtc_root(opened, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MTC_ROOT", str(tmp_path))
    assert cli.main(["gc", "--idle"]) == 0
    assert opened == [(str(tmp_path), "tmpfs")]
    assert capsys.readouterr().err == ""


def test_gc_root_flag_wins_over_mtc_root(opened, monkeypatch, tmp_path):
    (tmp_path / "flag").mkdir()
    monkeypatch.setenv("MTC_ROOT", str(tmp_path / "missing"))
    assert cli.main(["gc", "--idle", "--root", str(tmp_path / "flag")]) == 0
    assert opened == [(str(tmp_path / "flag"), "tmpfs")]


@pytest.mark.parametrize(
    ("mtc_root", "line"),
    [
        (None, "mtc gc: --root is required (or $MTC_ROOT, set in the node DaemonSet's pods)"),
        ("", "mtc gc: --root is required (or $MTC_ROOT, set in the node DaemonSet's pods)"),
        ("{tmp}/missing", "mtc gc: $MTC_ROOT {tmp}/missing: no such directory"),
        ("{tmp}/file", "mtc gc: $MTC_ROOT {tmp}/file: not a directory"),
    ],
)
def test_gc_without_a_usable_root_is_one_line_and_exit_2(opened, monkeypatch, tmp_path, capsys, mtc_root, line):
    (tmp_path / "file").write_text("")
    if mtc_root is not None:
        monkeypatch.setenv("MTC_ROOT", mtc_root.format(tmp=tmp_path))
    assert cli.main(["gc", "--idle"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line.format(tmp=tmp_path) + "\n")
    assert opened == [], "nothing is opened"
