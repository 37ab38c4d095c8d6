"""Regenerate tests/golden/sim_makespans.json from `rrfp sim --json`.

The file pins the simulator's per-seed makespans for every executor x hint, so
a refactor that changes a single decision fails `test_sim_golden.py`. Run it
only when a behaviour change is intended, and say so in the commit:

    .venv/bin/python tests/golden/make_sim_golden.py
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [  # (pp, mb, preset, budget, extra args)
    (4, 8, "none", "2x", []),
    (4, 8, "lang", "2x", []),
    (4, 8, "mm", "2x", []),
    (8, 16, "none", "2x", []),
    (8, 16, "lang", "2x", []),
    (8, 16, "mm", "2x", []),
    (4, 8, "moe", "2x", []),
    (8, 16, "moe", "1x", []),
    (4, 12, "lang", "1x", []),
    (4, 12, "lang", "3", []),
    (4, 12, "lang", "3MiB", []),
    (4, 12, "jitter", "2x", ["--slow-stage", "1", "--comm-jitter", "0.3"]),
]
SEEDS = 3


def case_args(pp, mb, preset, budget, extra):
    return [
        "--pp",
        str(pp),
        "--n-microbatches",
        str(mb),
        "--preset",
        preset,
        "--budget",
        budget,
        "--seeds",
        str(SEEDS),
        *extra,
    ]


def run_case(args) -> dict:
    """{"executor hint": [makespan per seed]} from one `rrfp sim --json` run."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        subprocess.run(
            [sys.executable, "-m", "rrfp", "sim", *args, "--json", str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        doc = json.loads(out.read_text())
    return {f"{r['dispatch']} {r['hint']}": r["makespans"] for r in doc["rows"]}


if __name__ == "__main__":
    golden = [{"args": case_args(*c), "makespans": run_case(case_args(*c))} for c in CASES]
    path = Path(__file__).with_name("sim_makespans.json")
    path.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {path} ({len(golden)} cases)")
