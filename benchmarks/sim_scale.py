"""Simulator scale: 128 stages x 1024 microbatches with ready BFW, timed.

A benchmark, not a test: run it and read the numbers.
    .venv/bin/python benchmarks/sim_scale.py [--pp 128 --mb 1024 --repeat 3]
"""
import argparse
import statistics
import time

from rrfp import SimConfig, Variability, simulate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--preset", default="lang")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    times = []
    for seed in range(a.repeat):
        t0 = time.perf_counter()
        r = simulate(SimConfig(a.pp, a.mb, "bfw", "ready", variability=Variability.preset(a.preset), seed=seed))
        times.append(time.perf_counter() - t0)
        print(f"seed {seed}: {times[-1]:.2f} s wall, {r.decisions} decisions, "
              f"{a.pp * a.mb * 3} tasks, makespan {r.makespan:.0f}, efficiency {r.efficiency:.3f}")
    print(f"S={a.pp} M={a.mb} ready bfw {a.preset}: median {statistics.median(times):.2f} s "
          f"(min {min(times):.2f}, max {max(times):.2f}) per simulated iteration")


if __name__ == "__main__":
    main()
