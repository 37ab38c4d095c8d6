"""Readiness alone: each ready row against the same order run as a fixed list, seed by seed.

`rrfp sim` divides every row by fixed 1F1B; this pairs a ready row with the fixed row of the same
hint and layout (a fixed order holds what it implies; a plan, the budget it was made under) and
gives the median of the per-seed ratios, fixed makespan over ready, with both peaks in flight so
that equal memory shows. A benchmark, not a test: run it and read the numbers.

    .venv/bin/python benchmarks/readiness_alone.py --from sim.json     # an `rrfp sim --json` file
    .venv/bin/python benchmarks/readiness_alone.py --preset moe --set moe_a2a=0.5 --set \
        moe_expert=0.25 --seeds 200 --json out.json   # a preset with other parameters, 8 x 32
"""

import argparse
import json

import numpy as np

from rrfp.core import Budget, Dispatch, Variability, VirtualLayout, resolve
from rrfp.sim import SimConfig, sweep

HINTS = "1f1b,zbh1,zbv,bfw,plan"


def run(a) -> dict:
    """`rrfp sim --json`'s rows, for a preset with ``--set`` overrides of its parameters."""
    over = {k: float(v) for k, v in (s.split("=", 1) for s in a.set)}
    var = Variability.preset(a.preset, **over)
    budgets = [Budget.parse(b) for b in a.budget.split(",")]
    layouts = [VirtualLayout(a.pp)] + ([VirtualLayout(a.pp, 2, "v")] if a.v else [])
    hints = [resolve(h) for h in HINTS.split(",") if a.v or h != "zbv"]
    base = SimConfig(a.pp, a.n_microbatches, budget=budgets[0], variability=var)
    rows = sweep(
        base, [Dispatch.FIXED, Dispatch.READY], hints, a.seeds, budgets=budgets, layouts=layouts
    )
    return {
        "pp": a.pp,
        "n_microbatches": a.n_microbatches,
        "preset": a.preset,
        "seeds": a.seeds,
        "variability": var.__dict__,
        "rows": [r.as_dict() for r in rows],
    }


def pairs(doc: dict) -> list[dict]:
    """Every ready row with the fixed row of its hint and layout (for a plan: its budget too)."""

    def key(r):
        return (r["hint"], r["virtual"], r["placement"])

    fixed = {(*key(r), r["budget"]): r for r in doc["rows"] if r["dispatch"] == "fixed"}
    out = []
    for r in doc["rows"]:
        if r["dispatch"] != "ready":
            continue
        f = fixed.get((*key(r), r["budget"])) or fixed.get((*key(r), None))
        if f is None:
            continue
        ratio = np.array(f["makespans"]) / np.array(r["makespans"])
        out.append(
            {
                "hint": r["hint"],
                "layout": f"V{r['virtual']} {r['placement']}" if r["virtual"] > 1 else "V1",
                "budget": r["budget"],
                "median": float(np.median(ratio)),
                "p10": float(np.percentile(ratio, 10)),
                "p90": float(np.percentile(ratio, 90)),
                "ready_peak": r["peak_inflight"],
                "fixed_peak": f["peak_inflight"],
                "ready_vs_1f1b": r["median_speedup"],
                "fixed_vs_1f1b": f["median_speedup"],
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--from", dest="src", help="an `rrfp sim --json` file instead of a run")
    p.add_argument("--preset", default="moe")
    p.add_argument("--set", action="append", default=[], help="a Variability field, k=v")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--n-microbatches", type=int, default=32)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--budget", default="2x,1x")
    p.add_argument("--v", action="store_true", help="also two stages per rank, v placement")
    p.add_argument("--json", help="write the run's rows here")
    a = p.parse_args()
    if a.src:
        with open(a.src) as f:
            doc = json.load(f)
    else:
        doc = run(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
    print(
        f"{doc['preset']} {doc['pp']}x{doc['n_microbatches']}, {doc['seeds']} seeds: readiness "
        "alone = fixed makespan / ready makespan of the same order, per seed"
    )
    print(
        f"{'hint':<6} {'layout':<8} {'budget':>6} {'ready/fixed':>11} {'p10..p90':>12} "
        f"{'peaks r/f':>9} {'ready vs 1f1b':>13} {'fixed vs 1f1b':>13}"
    )
    for q in sorted(pairs(doc), key=lambda q: (q["layout"], q["hint"], q["budget"] or "")):
        print(
            f"{q['hint']:<6} {q['layout']:<8} {q['budget'] or '':>6} {q['median']:>10.3f}x "
            f"{q['p10']:>5.3f}..{q['p90']:<5.3f} {q['ready_peak']:>4g}/{q['fixed_peak']:<4g} "
            f"{q['ready_vs_1f1b']:>12.3f}x {q['fixed_vs_1f1b']:>12.3f}x"
            + ("" if q["ready_peak"] == q["fixed_peak"] else "  (not at equal memory)")
        )


if __name__ == "__main__":
    main()
