"""Every relative link in README.md and docs/ points at a file of the repository, and
every ``#anchor`` at a heading of its target.

The reference is the file system and the headings as GitHub renders them (lower-cased,
punctuation other than ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2`` ... for
repeats), not any code of lrmoe. Links inside fenced code blocks and inline code are not
links and are skipped; so are absolute URLs.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> List[str]:
    """The lines of a markdown text outside fenced code blocks, inline code removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(_INLINE_CODE.sub("", line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading text."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> Set[str]:
    """Every heading anchor of a markdown file (repeats numbered as GitHub does)."""
    seen: Dict[str, int] = {}
    anchors: Set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = _slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def broken_links(md_files: List[Path]) -> List[Tuple[str, str]]:
    """(file, link) for every relative link whose file or anchor does not exist."""
    bad = []
    for md in md_files:
        for line in _prose_lines(md.read_text(encoding="utf-8")):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (md.parent / path_part).resolve() if path_part else md
                if not dest.exists():
                    bad.append((str(md), target))
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    bad.append((str(md), target))
    return bad


def _docs() -> List[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def test_every_relative_link_in_readme_and_docs_resolves():
    files = _docs()
    assert len(files) >= 10, files    # README + the docs pages + the journal
    assert broken_links(files) == []


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` section, here\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#title) [ok](a.md#some-code-section-here) [ok](#local)\n"
        "# Local\n"
        "[gone](missing.md) [gone](a.md#nope) ![gone](img/x.png)\n"
        "`[not a link](missing.md)` [web](https://example.com/x)\n"
        "```\n[in code](missing.md)\n```\n")
    assert broken_links([page]) == [(str(page), "missing.md"), (str(page), "a.md#nope"),
                                    (str(page), "img/x.png")]
