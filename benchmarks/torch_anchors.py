"""torch.distributed.pipelining's schedules next to rrfp's dispatch modes, on one model, data
and durations.

A thin wrapper with its own command line: the work is `rrfp bench` with the
torch anchors (rrfp/app/bench/torch_schedules.py) and rrfp's fixed 1F1B and
ready BFW on the tiny GPT with n_layer 8 (the two-stage-per-rank schedules
need 2 x 4 stages), on the same microbatches and emulated durations (CPU
machine: device time is emulated), rotating the order every iteration. The
bench reports the median and spread of the slowest rank's iteration time, the
paired speedup over fixed 1F1B and the simulator's prediction, in a results
folder.

    .venv/bin/python benchmarks/torch_anchors.py [--n-microbatches 16 --preset lang --unit-ms 20
        --reps 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

TORCH = ("1f1b", "zbv", "interleaved-zb", "dualpipev")
RRFP = ("fixed-1f1b", "ready-bfw")


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt", help="gpt, vlm or a .toml config (default gpt)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides (the suite's gpt already has model.n_layer=8)",
    )
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--n-microbatches", type=int, default=16)
    p.add_argument("--preset", default="lang")
    p.add_argument("--unit-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=5, help="measured iterations per variant")
    p.add_argument("--torch", default=",".join(TORCH), help="torch schedules, comma-separated")
    p.add_argument(
        "--torch-sends",
        choices=("delayed", "native"),
        default="delayed",
        help="delayed: torch's sends leave after the emulated link latency, from sender threads; "
        "native: torch issues and waits its own sends, with no latency",
    )
    p.add_argument("--out", help="results folder (default results/bench-<timestamp>)")
    return p.parse_args()


def main() -> int:
    a = parse()
    contenders = [f"torch-{name}" for name in a.torch.split(",") if name] + list(RRFP)
    argv = [
        "bench",
        "--workloads",
        a.config,
        "--contenders",
        ",".join(contenders),
        "--pp",
        str(a.world),
        "--n-microbatches",
        str(a.n_microbatches),
        "--preset",
        a.preset,
        "--unit-ms",
        str(a.unit_ms),
        "--reps",
        str(a.reps),
        "--torch-sends",
        a.torch_sends,
        *(["--out", a.out] if a.out else []),
    ]
    for s in a.set:
        argv += ["--set", s]
    return subprocess.run([sys.executable, "-m", "rrfp", *argv]).returncode


if __name__ == "__main__":
    sys.exit(main())
