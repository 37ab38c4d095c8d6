"""Many-seed comparisons of dispatch modes x hints against fixed 1F1B, for `rrfp sim`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np

from rrfp.core.budget import Budget
from rrfp.core.hints import Hint, HintError, default_split, resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.tasks import Kind
from rrfp.sim.engine import SimConfig, SimResult, simulate
from rrfp.sim.planned_hint import planned_config

BASELINE = (Dispatch.FIXED, resolve("1f1b"))

RowKey: TypeAlias = tuple[str, str, str | None, str]  # ``Row.key``: dispatch, hint, budget, layout
Combo: TypeAlias = tuple[Dispatch, str, Budget | None, VirtualLayout]  # None: no budget applies
Job: TypeAlias = tuple[int, Combo]  # (seed, combo)


def layout_label(virtual: int, placement: str) -> str:
    """``V2 v``, ``V2 interleaved``; empty with one stage per rank (a row's ``layout``, part of its
    key)."""
    return f"V{virtual} {placement}" if virtual > 1 else ""


@dataclass
class Row:
    dispatch: str  # "fixed" or "ready"
    hint: str
    speedups: list[float]
    efficiencies: list[float]
    # the most microbatches any rank held (of its whole model: V local stages make one), over
    # every seed: the row's memory
    peak_inflight: float
    bubble: float
    stage_bubble: list[float]  # per-stage idle fraction, mean over seeds
    makespans: list[float]
    plan_s: list[float]  # planning time per seed ("plan" rows only)
    # the in-flight budget it ran under; None: fixed dispatch of an order, which has none
    budget: str | None = None
    virtual: int = 1  # stages per rank
    placement: str = "interleaved"

    @property
    def layout(self) -> str:
        return layout_label(self.virtual, self.placement)

    @property
    def key(self) -> tuple[str, str, str | None, str]:
        return self.dispatch, self.hint, self.budget, self.layout

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

    def as_dict(self) -> dict[str, object]:
        lo, hi = self.spread
        return {
            "dispatch": self.dispatch,
            "hint": self.hint,
            "budget": self.budget,
            "median_speedup": self.median,
            "p10_speedup": lo,
            "p90_speedup": hi,
            "median_efficiency": self.median_efficiency,
            "virtual": self.virtual,
            "placement": self.placement,
            "peak_inflight": self.peak_inflight,
            "mean_bubble": self.bubble,
            "stage_bubble": self.stage_bubble,
            "speedups": self.speedups,
            "makespans": self.makespans,
            **({"median_plan_ms": 1e3 * float(np.median(self.plan_s))} if self.plan_s else {}),
        }


def as_run(durations: np.ndarray, split: bool) -> np.ndarray:
    """``[stage, mb, kind]`` task times as a run with(out) a split backward holds them: unsplit, B
    holds W and W is zero."""
    if split:
        return durations
    out = np.array(durations, dtype=np.float64)
    out[..., Kind.B] += out[..., Kind.W]
    out[..., Kind.W] = 0.0
    return out


def budget_applies(dispatch: Dispatch, hint: Hint) -> bool:
    """Ready dispatch holds the budget; fixed dispatch follows its order and holds what the order
    implies, except a plan's, which ready dispatch made under the budget."""
    return dispatch is Dispatch.READY or hint.planned


def applies(hint: Hint, layout: VirtualLayout, n_microbatches: int, split: bool) -> str | None:
    """None when ``hint`` has a form on ``layout``; else why not (e.g. zbh1 has no virtual
    order)."""
    try:
        hint.check_layout(layout, n_microbatches, split)
    except HintError as e:
        return str(e)
    return None


def sweep(
    base: SimConfig,
    dispatches: Iterable[Dispatch],
    hints: Iterable[Hint],
    seeds: int,
    progress: Callable[[list[Job]], Iterable[Job]] = lambda x: x,
    runs: dict[RowKey, list[tuple[SimConfig, SimResult]]] | None = None,
    budgets: Sequence[Budget] = (),
    layouts: Sequence[VirtualLayout] = (),
    skipped: list[str] | None = None,
    durations: Sequence[np.ndarray] = (),
) -> list[Row]:
    """Every (dispatch, hint, budget, layout) on the same durations for each seed; speedup is
    fixed 1F1B's makespan (one stage per rank) over the configuration's, seed by seed. ``budgets``
    (default: the base config's) are run by every row they apply to (``budget_applies``); the
    others run once.
    ``layouts`` (default: the base config's) are the virtual-stage layouts to run; a hint with no
    form on a layout (zbh1 with V > 1, zbv with V = 1) is left out, and ``skipped`` receives why.
    ``runs``, when given, receives every (config as run, recorded result) by ``Row.key``, seed
    by seed, for callers that need the schedules themselves (rrfp sim --oracle).
    ``durations``, when given, are each seed's task times (a recorded run's:
    rrfp.sim.routing_replay) in place of the preset's draws; a plan is still made from what the
    preset lets a planner know."""
    budgets = list(budgets) or [Budget.parse(base.budget)]
    layouts = list(dict.fromkeys(layouts or [base.layout]))
    base = replace(base, virtual=1, placement="interleaved")
    one = VirtualLayout(base.pp)
    by_name = {h.name: h for h in [BASELINE[1], *hints]}
    pairs = list(
        dict.fromkeys(
            [
                (d, h.name, lay)
                for d, h, lay in [(*BASELINE, one), *itertools.product(dispatches, hints, layouts)]
            ]
        )
    )
    usable: list[tuple[Dispatch, str, VirtualLayout]] = []
    for d, name, lay in pairs:
        why = applies(by_name[name], lay, base.n_microbatches, default_split(name, base.split))
        if why is None:
            usable.append((d, name, lay))
        elif skipped is not None and why not in skipped:
            skipped.append(why)
    combos: list[Combo] = [
        (d, name, b if budget_applies(d, by_name[name]) else None, lay)
        for d, name, lay in usable
        for b in (budgets if budget_applies(d, by_name[name]) else budgets[:1])
    ]
    results: dict[Combo, list[SimResult]] = {c: [] for c in combos}
    jobs = [(seed, c) for seed in range(seeds) for c in combos]
    plan_s: dict[Combo, list[float]] = {c: [] for c in combos}
    for seed, combo in progress(jobs):
        dispatch, name, budget, lay = combo
        cfg = replace(
            base,
            dispatch=dispatch,
            hint=by_name[name],
            budget=budget or budgets[0],
            seed=seed,
            record=runs is not None,
            virtual=lay.virtual,
            placement=lay.placement,
        )
        if by_name[name].planned:
            cfg, made = planned_config(cfg)
            plan_s[combo].append(made.seconds)
        if durations:
            cfg = replace(cfg, durations=as_run(durations[seed], cfg.split_backward))
        results[combo].append(simulate(cfg))
        if runs is not None:
            key = (
                str(dispatch),
                name,
                None if budget is None else str(budget),
                layout_label(lay.virtual, lay.placement),
            )
            runs.setdefault(key, []).append((cfg, results[combo][-1]))
    base_ms = np.array([r.makespan for r in results[(BASELINE[0], BASELINE[1].name, None, one)]])
    rows = []
    for (dispatch, name, budget, lay), rs in results.items():
        ms = np.array([r.makespan for r in rs])
        rows.append(
            Row(
                str(dispatch),
                name,
                (base_ms / ms).tolist(),
                [r.efficiency for r in rs],
                max(max(r.peak_microbatches) for r in rs),
                float(np.mean([r.bubble_ratio for r in rs])),
                np.mean([r.bubble for r in rs], axis=0).tolist(),
                ms.tolist(),
                plan_s[(dispatch, name, budget, lay)],
                None if budget is None else str(budget),
                lay.virtual,
                str(lay.placement),
            )
        )
    return rows
