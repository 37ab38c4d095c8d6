"""Many-seed comparisons of executors x hints against fixed 1F1B, for `rrfp sim`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np

from rrfp.core.hints import Hint, resolve
from rrfp.core.policy import Dispatch
from rrfp.sim.engine import SimConfig, SimResult, simulate
from rrfp.sim.planning import planned_config

BASELINE = (Dispatch.FIXED, resolve("1f1b"))


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
    plan_s: list[float]  # planning time per seed ("plan" rows only)

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
                "stage_bubble": self.stage_bubble, "speedups": self.speedups, "makespans": self.makespans,
                **({"median_plan_ms": 1e3 * float(np.median(self.plan_s))} if self.plan_s else {})}


def sweep(base: SimConfig, dispatches: Iterable[Dispatch], hints: Iterable[Hint], seeds: int,
          progress: Callable[[Iterable], Iterable] = lambda x: x,
          runs: dict[tuple[str, str], list[tuple[SimConfig, SimResult]]] | None = None) -> list[Row]:
    """Every (executor, hint) on the same durations for each seed; speedup is
    fixed 1F1B's makespan over the configuration's, seed by seed. ``runs``, when
    given, receives every (config as run, recorded result) by (executor, hint), seed
    by seed, for callers that need the schedules themselves (rrfp sim --oracle)."""
    combos = list(dict.fromkeys([(d, h.name) for d, h in [BASELINE, *itertools.product(dispatches, hints)]]))
    by_name = {h.name: h for h in [BASELINE[1], *hints]}
    results: dict[tuple[Dispatch, str], list[SimResult]] = {c: [] for c in combos}
    jobs = [(seed, c) for seed in range(seeds) for c in combos]
    plan_s: dict[tuple[Dispatch, str], list[float]] = {c: [] for c in combos}
    for seed, (dispatch, name) in progress(jobs):
        cfg = replace(base, dispatch=dispatch, hint=by_name[name], seed=seed, record=runs is not None)
        if by_name[name].planned:
            cfg, made = planned_config(cfg)
            plan_s[(dispatch, name)].append(made.seconds)
        results[(dispatch, name)].append(simulate(cfg))
        if runs is not None:
            runs.setdefault((str(dispatch), name), []).append((cfg, results[(dispatch, name)][-1]))
    base_ms = np.array([r.makespan for r in results[(BASELINE[0], BASELINE[1].name)]])
    rows = []
    for (dispatch, name), rs in results.items():
        ms = np.array([r.makespan for r in rs])
        rows.append(Row(str(dispatch), name, (base_ms / ms).tolist(), [r.efficiency for r in rs],
                        max(max(r.peak_inflight) for r in rs), float(np.mean([r.bubble_ratio for r in rs])),
                        np.mean([r.bubble for r in rs], axis=0).tolist(), ms.tolist(), plan_s[(dispatch, name)]))
    return rows
