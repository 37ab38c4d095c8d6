"""Many-seed comparisons of executors x hints against fixed 1F1B, for `rrfp sim`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np

from .engine import SimConfig, SimResult, simulate

BASELINE = ("fixed", "1f1b")


@dataclass
class Row:
    executor: str
    hint: str
    speedups: list[float]
    efficiencies: list[float]
    peak_inflight: int
    bubble: float
    stage_bubble: list[float]  # per-stage idle fraction, mean over seeds
    makespans: list[float]

    @property
    def median(self) -> float:
        return float(np.median(self.speedups))

    @property
    def median_efficiency(self) -> float:
        return float(np.median(self.efficiencies))

    @property
    def spread(self) -> tuple[float, float]:
        """10th and 90th percentile of per-seed speedups."""
        return float(np.percentile(self.speedups, 10)), float(np.percentile(self.speedups, 90))

    def as_dict(self) -> dict:
        lo, hi = self.spread
        return {"executor": self.executor, "hint": self.hint, "median_speedup": self.median,
                "p10_speedup": lo, "p90_speedup": hi, "median_efficiency": self.median_efficiency,
                "peak_inflight": self.peak_inflight, "mean_bubble": self.bubble,
                "stage_bubble": self.stage_bubble, "speedups": self.speedups, "makespans": self.makespans}


def sweep(base: SimConfig, executors: Iterable[str], hints: Iterable[str], seeds: int,
          progress: Callable[[Iterable], Iterable] = lambda x: x) -> list[Row]:
    """Every (executor, hint) on the same durations for each seed; speedup is
    fixed 1F1B's makespan over the configuration's, seed by seed."""
    combos = list(dict.fromkeys([BASELINE, *itertools.product(executors, hints)]))
    results: dict[tuple[str, str], list[SimResult]] = {c: [] for c in combos}
    jobs = [(seed, c) for seed in range(seeds) for c in combos]
    for seed, (ex, hint) in progress(jobs):
        cfg = replace(base, executor=ex, hint=hint, seed=seed)
        results[(ex, hint)].append(simulate(cfg))
    base_ms = np.array([r.makespan for r in results[BASELINE]])
    rows = []
    for (ex, hint), rs in results.items():
        ms = np.array([r.makespan for r in rs])
        rows.append(Row(ex, hint, (base_ms / ms).tolist(), [r.efficiency for r in rs],
                        max(max(r.peak_inflight) for r in rs), float(np.mean([r.bubble_ratio for r in rs])),
                        np.mean([r.bubble for r in rs], axis=0).tolist(), ms.tolist()))
    return rows
