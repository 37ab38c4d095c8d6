"""Many-seed comparisons of executors x hints against fixed 1F1B, for `rrfp sim`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from rrfp.core.budget import Budget
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
    peak_inflight: int  # the most microbatches any stage held, over every seed: the row's memory
    bubble: float
    stage_bubble: list[float]  # per-stage idle fraction, mean over seeds
    makespans: list[float]
    plan_s: list[float]  # planning time per seed ("plan" rows only)
    budget: str | None = None  # the in-flight budget it ran under; None: fixed dispatch of an order, which has none

    @property
    def key(self) -> tuple[str, str, str | None]:
        return self.executor, self.hint, self.budget

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
        return {"executor": self.executor, "hint": self.hint, "budget": self.budget, "median_speedup": self.median,
                "p10_speedup": lo, "p90_speedup": hi, "median_efficiency": self.median_efficiency,
                "peak_inflight": self.peak_inflight, "mean_bubble": self.bubble,
                "stage_bubble": self.stage_bubble, "speedups": self.speedups, "makespans": self.makespans,
                **({"median_plan_ms": 1e3 * float(np.median(self.plan_s))} if self.plan_s else {})}


def budget_applies(dispatch: Dispatch, hint: Hint) -> bool:
    """Ready dispatch holds the budget; fixed dispatch follows its order and holds what the order
    implies, except a plan's, which ready dispatch made under the budget."""
    return dispatch is Dispatch.READY or hint.planned


def sweep(base: SimConfig, dispatches: Iterable[Dispatch], hints: Iterable[Hint], seeds: int,
          progress: Callable[[Iterable], Iterable] = lambda x: x,
          runs: dict[tuple[str, str, str | None], list[tuple[SimConfig, SimResult]]] | None = None,
          budgets: Sequence[Budget] = ()) -> list[Row]:
    """Every (executor, hint, budget) on the same durations for each seed; speedup is fixed
    1F1B's makespan over the configuration's, seed by seed. ``budgets`` (default: the base
    config's) are run by every row they apply to (``budget_applies``); the others run once.
    ``runs``, when given, receives every (config as run, recorded result) by ``Row.key``, seed
    by seed, for callers that need the schedules themselves (rrfp sim --oracle)."""
    budgets = list(budgets) or [base.budget]
    by_name = {h.name: h for h in [BASELINE[1], *hints]}
    pairs = list(dict.fromkeys([(d, h.name) for d, h in [BASELINE, *itertools.product(dispatches, hints)]]))
    combos = [(d, name, b if budget_applies(d, by_name[name]) else None)
              for d, name in pairs for b in (budgets if budget_applies(d, by_name[name]) else budgets[:1])]
    results: dict[tuple, list[SimResult]] = {c: [] for c in combos}
    jobs = [(seed, c) for seed in range(seeds) for c in combos]
    plan_s: dict[tuple, list[float]] = {c: [] for c in combos}
    for seed, (dispatch, name, budget) in progress(jobs):
        cfg = replace(base, dispatch=dispatch, hint=by_name[name], budget=budget or budgets[0], seed=seed,
                      record=runs is not None)
        if by_name[name].planned:
            cfg, made = planned_config(cfg)
            plan_s[(dispatch, name, budget)].append(made.seconds)
        results[(dispatch, name, budget)].append(simulate(cfg))
        if runs is not None:
            key = (str(dispatch), name, None if budget is None else str(budget))
            runs.setdefault(key, []).append((cfg, results[(dispatch, name, budget)][-1]))
    base_ms = np.array([r.makespan for r in results[(BASELINE[0], BASELINE[1].name, None)]])
    rows = []
    for (dispatch, name, budget), rs in results.items():
        ms = np.array([r.makespan for r in rs])
        rows.append(Row(str(dispatch), name, (base_ms / ms).tolist(), [r.efficiency for r in rs],
                        max(max(r.peak_inflight) for r in rs), float(np.mean([r.bubble_ratio for r in rs])),
                        np.mean([r.bubble for r in rs], axis=0).tolist(), ms.tolist(),
                        plan_s[(dispatch, name, budget)], None if budget is None else str(budget)))
    return rows
