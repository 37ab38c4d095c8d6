"""Every relative link in README.md and docs/*.md names a file or folder of the repository, and
every #anchor on a link to a Markdown page names one of its headings: the pages are rewritten
often, and a link that points nowhere is only found by a reader who follows it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), inline links only
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def links(page: Path) -> list[str]:
    """The page's relative link targets, outside code blocks and code spans."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What each of the page's relative links lacks, one line each."""
    out = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{page.relative_to(root)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{page.relative_to(root)}: {target}: no heading #{anchor}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_the_pages_have_links_to_check():
    """The pattern still matches the pages' links (a broken pattern would pass every page)."""
    assert len(links(ROOT / "README.md")) >= 10


def test_the_check_finds_a_link_that_points_nowhere(tmp_path):
    """The checker itself: a missing file and a missing heading are both reported."""
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope)\n"
        "`[code](span.md)`\n```\n[fenced](block.md)\n```\n[web](https://example.com/x)\n"
    )
    found = [line.split(": ", 1)[1] for line in broken(page, tmp_path)]
    assert found == ["missing.md: no such file", "there.md#nope: no heading #nope"]
