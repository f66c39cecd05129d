"""Markdown as GitHub renders it: headings and their anchors, prose outside fenced code."""

import re
import unicodedata
from pathlib import Path

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`([^`]+)`")


def prose_lines(path: Path) -> list[str]:
    """The page's lines with fenced code blocks blanked (links and headings there are not markdown)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return lines


def slug(title: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(r"\1", title)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading renders as its text
    text = text.replace("*", "").lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of the page (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group("title"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result
