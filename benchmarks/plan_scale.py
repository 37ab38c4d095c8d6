"""Planning scale: how long one iteration's plan takes, against the iteration it plans.

A benchmark, not a test: run it and read the numbers.
    .venv/bin/python benchmarks/plan_scale.py [--sizes 8x32,32x128,128x1024 --repeat 3 --unit-ms 20]

For each S x M under `lang` (budget 2x): the CPU time of ``planned_config`` (the preset's known
part, every candidate entry order scored; time.process_time, which other jobs on a shared machine
disturb less than wall time), the predicted iteration in units, and the plan's share of that
iteration at ``--unit-ms`` per unit: what planning one iteration ahead must stay well below.
"""

import argparse
import os
import statistics
import time

from rrfp import SimConfig, Variability, planned_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="8x32,32x128,128x1024")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--unit-ms", type=float, default=20.0)
    a = p.parse_args()
    print(
        f"lang, budget 2x, ready plan; CPU time of one plan (median of {a.repeat} seeds, "
        f"min..max); load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'S x M':>9} {'plan CPU ms':>12} {'min..max':>17} {'predicted units':>16} "
        f"{'share at ' + str(a.unit_ms) + ' ms':>15}"
    )
    for size in a.sizes.split(","):
        S, M = (int(x) for x in size.lower().split("x"))
        secs, units = [], []
        for seed in range(a.repeat):
            cfg = SimConfig(S, M, "plan", "ready", "2x", Variability.preset("lang"), seed=seed)
            c0 = time.process_time()
            _, made = planned_config(cfg)
            secs.append(time.process_time() - c0)
            units.append(made.predicted_makespan)
        cpu, pred = statistics.median(secs), statistics.median(units)
        print(
            f"{size:>9} {1e3 * cpu:>12.1f} {1e3 * min(secs):>8.1f}..{1e3 * max(secs):<8.1f} "
            f"{pred:>16.1f} {cpu / (pred * a.unit_ms / 1e3):>15.2%}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
