"""The house's measures, read from the source (nothing imported): how many modules each folder of
rrfp/ holds, against the most one may hold. ``make stats`` prints them; tests/test_layers.py holds
the code to the limits.

    python tools/stats.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST_MODULES = 20  # a folder with more is several ideas: split it into rooms


def modules_per_folder(root: Path = ROOT) -> dict[str, int]:
    """Each folder of rrfp/ (and below) -> its modules, ``__init__.py`` not counted."""
    counts = {}
    rrfp = root / "rrfp"
    for folder in [rrfp, *sorted(p for p in rrfp.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        counts[str(folder.relative_to(root))] = sum(
            1 for f in folder.glob("*.py") if f.name != "__init__.py"
        )
    return counts


def report(root: Path = ROOT) -> tuple[list[str], bool]:
    """The lines ``make stats`` prints, and whether every measure is within its limit."""
    counts = modules_per_folder(root)
    over = {f: n for f, n in counts.items() if n > MOST_MODULES}
    lines = [f"modules per folder of rrfp/ (at most {MOST_MODULES}):"]
    lines += [f"  {n:3d}  {f}{'  OVER' if f in over else ''}" for f, n in counts.items()]
    return lines, not over


def main() -> int:
    lines, ok = report()
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
