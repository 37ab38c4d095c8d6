"""Two rows of several `rrfp bench` runs, pooled: is their ratio above the runs' own spread?

One run's median of paired per-iteration ratios moves from run to run by more than its own IQR
suggests (the machine's state changes between runs, not only between iterations), so a line such
as "fixed 1F1B at least 0.98x torch's 1F1B" is judged on several runs. For each run and workload:
the median and IQR of ``wall(B) / wall(A)`` over the iterations both rows ran (A's speed over B's);
pooled over the runs: the median of every pair, with a 95% interval from a bootstrap that
resamples runs and then each run's iterations, so one unusual run weighs as a run.

    .venv/bin/python benchmarks/paired_runs.py "fixed 1f1b" "torch 1f1b" RUN/results.json ...
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def paired(path: str, a: str, b: str) -> dict[str, np.ndarray]:
    """Per workload of one run's results.json: B's wall time over A's, per iteration."""
    with open(path) as f:
        run = json.load(f)
    out = {}
    for wl in run["workloads"]:
        wall: dict[str, dict[int, float]] = {}
        for row in wl["rows"]:
            wall.setdefault(row["contender"], {})[row["iteration"]] = row["wall_s"]
        if a in wall and b in wall:
            both = sorted(set(wall[a]) & set(wall[b]))
            out[wl["name"]] = np.array([wall[b][i] / wall[a][i] for i in both])
    return out


def pooled(runs: list[np.ndarray], draws: int, seed: int = 0) -> tuple[float, float, float]:
    """The median of every pair, and its 95% interval over runs, then iterations."""
    rng = np.random.default_rng(seed)
    medians = []
    for _ in range(draws):
        picked = [runs[i] for i in rng.integers(0, len(runs), len(runs))]
        medians.append(
            np.median(np.concatenate([r[rng.integers(0, len(r), len(r))] for r in picked]))
        )
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(np.median(np.concatenate(runs))), float(lo), float(hi)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="the row whose speed is reported, e.g. 'fixed 1f1b'")
    p.add_argument("b", help="the row it is paired with, e.g. 'torch 1f1b'")
    p.add_argument("results", nargs="+", help="results.json of `rrfp bench` runs")
    p.add_argument("--draws", type=int, default=4000)
    args = p.parse_args()
    by_workload: dict[str, list[np.ndarray]] = {}
    for path in args.results:
        for name, ratios in paired(path, args.a, args.b).items():
            q1, med, q3 = np.percentile(ratios, [25, 50, 75])
            print(f"{path} {name}: {med:.3f}x (IQR {q1:.3f}..{q3:.3f}), {len(ratios)} pairs")
            by_workload.setdefault(name, []).append(ratios)
    if not by_workload:
        raise SystemExit(f"no run has both rows {args.a!r} and {args.b!r}")
    for name, runs in by_workload.items():
        med, lo, hi = pooled(runs, args.draws)
        n = sum(len(r) for r in runs)
        print(
            f"{name}: {args.a} over {args.b}, pooled over {len(runs)} run(s) and {n} pairs: "
            f"{med:.3f}x (95% interval {lo:.3f}..{hi:.3f})"
        )


if __name__ == "__main__":
    main()
