"""Where the test suite's CPU goes, from the rows tests/harness/cpu_times.py writes when a run has
``RRFP_TEST_CPU=DIR``: the CPU seconds and wall seconds of each tier, then the dearest files and
tests. CPU seconds do not depend on the machine's load, so two runs compare on a busy machine;
`make test`'s bound is wall time on 2 cores, about half the CPU seconds of a run that keeps both
busy. ``make test-cpu`` runs `make test`'s tests with the rows on and prints this.

    python tools/test_cpu.py DIR [--top N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def read_rows(where: Path) -> list[dict]:
    rows = []
    for path in sorted(where.glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return rows


def cpu(row: dict) -> float:
    return row["self_s"] + row["below_s"]


def totals(rows: list[dict], key: str) -> dict[str, list[float]]:
    """{row[key]: [CPU seconds, wall seconds, tests]}, dearest first."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        t = out[row[key]]
        t[0] += cpu(row)
        t[1] += row["wall_s"]
        t[2] += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def report(rows: list[dict], top: int) -> str:
    lines = [f"{'tier':<10} {'CPU-s':>8} {'wall-s':>8} {'tests':>6}"]
    every = totals(rows, "tier")
    every["all"] = [sum(v[i] for v in every.values()) for i in range(3)]
    for tier, (c, w, n) in every.items():
        lines.append(f"{tier:<10} {c:8.1f} {w:8.1f} {n:6d}")
    bad = [r["test"] for r in rows if r.get("outcome", "passed") == "failed"]
    if bad:  # a test that failed early spent less than it would have: not a saving
        lines.append(f"failed ({len(bad)}, their CPU-s is short): " + ", ".join(bad))
    for key, title in (("file", "files"), ("test", "tests")):
        lines.append(f"\ndearest {top} {title}: CPU-s  wall-s  tests  name")
        for name, (c, w, n) in list(totals(rows, key).items())[:top]:
            lines.append(f"{c:8.1f} {w:7.1f} {n:6d}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("where", type=Path, help="the RRFP_TEST_CPU folder of a run")
    parser.add_argument("--top", type=int, default=25, help="files and tests listed (25)")
    args = parser.parse_args(argv)
    rows = read_rows(args.where)
    if not rows:
        print(f"test_cpu: no rows in {args.where} (run the tests with RRFP_TEST_CPU={args.where})")
        return 1
    print(report(rows, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
