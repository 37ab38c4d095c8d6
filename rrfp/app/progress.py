"""Progress bars for long commands: tqdm on stderr, and nothing when stderr is not a terminal
(CI logs, pipes), so only the commands' own lines reach files."""

from __future__ import annotations

from tqdm import tqdm


def progress(
    jobs=None, *, total: int | None = None, desc: str, unit: str = "run", leave: bool = True
) -> tqdm:
    """A bar over ``jobs`` (an iterable), or one advanced by hand up to ``total``."""
    import sys

    return tqdm(
        jobs,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=leave,
        dynamic_ncols=True,
    )
