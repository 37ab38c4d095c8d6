"""Simulator scale: 128 stages x 1024 microbatches with ready BFW, timed.

A benchmark, not a test: run it and read the numbers.
    .venv/bin/python benchmarks/sim_scale.py [--pp 128 --n-microbatches 1024 --repeat 3]
        [--reference]

Times are CPU seconds of this process (time.process_time), which other jobs on a shared
machine disturb less than wall time; the wall time and the load average are printed beside.
``--reference`` steps every StageTracker instead of the fast path (rrfp/sim/ranked.py).
"""

import argparse
import os
import statistics
import time

from rrfp import SimConfig, Variability, simulate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--n-microbatches", type=int, default=1024)
    p.add_argument("--preset", default="lang")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--reference", action="store_true", help="step the trackers (the fast path's reference)"
    )
    a = p.parse_args()
    times = []
    for seed in range(a.repeat):
        cfg = SimConfig(
            a.pp,
            a.n_microbatches,
            "bfw",
            "ready",
            variability=Variability.preset(a.preset),
            seed=seed,
        )
        c0, w0 = time.process_time(), time.perf_counter()
        r = simulate(cfg, reference=a.reference)
        times.append(time.process_time() - c0)
        print(
            f"seed {seed}: {times[-1]:.2f} s CPU ({time.perf_counter() - w0:.2f} s wall), "
            f"{r.decisions} decisions, {a.pp * a.n_microbatches * 3} tasks, "
            f"makespan {r.makespan:.0f}, efficiency {r.efficiency:.3f}",
            flush=True,
        )
    path = "reference (trackers)" if a.reference else "fast path"
    print(
        f"S={a.pp} M={a.n_microbatches} ready bfw {a.preset}, {path}: "
        f"median {statistics.median(times):.2f} s CPU (min {min(times):.2f}, max {max(times):.2f}) "
        f"per simulated iteration; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
