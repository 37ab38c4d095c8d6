"""Fixed 1F1B vs ready BFW on the tiny GPT, on real gloo ranks in emulated device time.

A thin wrapper, kept for `make run` and old command lines: the work is
`rrfp bench --workloads gpt --contenders fixed-1f1b,ready-bfw` (rrfp/app/bench/),
which alternates the two on the same iterations and reports medians,
spreads, the simulator's prediction and the decision cost (with --tp 2, TP
agreement included) in a results folder.

    .venv/bin/python benchmarks/compare_executors.py \
        [--pp 4 --tp 1 --mb 16 --preset lang --reps 5 --unit-ms 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", default="4")
    p.add_argument("--tp", default="1", help="tensor-parallel ranks per stage (world = pp * tp)")
    p.add_argument("--mb", default="16")
    p.add_argument("--preset", default="lang")
    p.add_argument("--reps", default="5", help="iterations per contender (alternating)")
    p.add_argument("--unit-ms", default="20")
    p.add_argument("--budget", default="2x")
    p.add_argument("--out", help="results folder (default results/bench-<timestamp>)")
    p.add_argument("--quick", action="store_true", help="3 iterations per contender (make run)")
    return p.parse_args()


if __name__ == "__main__":
    a = parse()
    argv = [
        "bench",
        "--workloads",
        "gpt",
        "--contenders",
        "fixed-1f1b,ready-bfw",
        "--pp",
        a.pp,
        "--tp",
        a.tp,
        "--mb",
        a.mb,
        "--preset",
        a.preset,
        "--reps",
        "3" if a.quick else a.reps,
        "--unit-ms",
        a.unit_ms,
        "--budget",
        a.budget,
        *(["--out", a.out] if a.out else []),
    ]
    sys.exit(subprocess.run([sys.executable, "-m", "rrfp", *argv]).returncode)
