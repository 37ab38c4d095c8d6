"""The table of a bench run's results.md, read back by contender (the bench's e2e tests)."""

from __future__ import annotations


def table_rows(markdown: str) -> dict[str, list[str]]:
    """contender -> its table cells, from results.md."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            line.startswith("| ")
            and cells[0] not in ("contender",)
            and not cells[0].startswith("---")
        ):
            rows[cells[0]] = cells
    return rows
