"""From measured iterations to the bench's figures: each iteration's lower
bound and the simulator's prediction for the same durations, then per
contender the median and spread of its time, its speedup over fixed 1F1B
(the median of per-iteration ratios: alternated iterations are paired), and
its efficiency against the bound.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import numpy as np

from rrfp.app.bench.suite import BASELINE, BenchSpec, Case, Contender
from rrfp.core.bounds import lower_bound
from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planned_hint import plan_iteration

log = logging.getLogger("rrfp.app.bench.analysis")


@dataclass(frozen=True)
class IterationWork:
    """An iteration's task costs in seconds of emulated device time, one per (iteration, split)."""

    durations: np.ndarray  # [S, M, 3] units (S x V global stages with virtual stages)
    lat_fwd: np.ndarray  # [S, M] units (zero on the V turn: no message)
    lat_bwd: np.ndarray
    split: bool
    unit_s: float
    rank_of: tuple[int, ...] | None = None  # virtual stages: the rank of each global stage

    @property
    def lower_bound_s(self) -> float:
        return (
            lower_bound(self.durations, self.lat_fwd, self.lat_bwd, self.split, self.rank_of)
            * self.unit_s
        )


def virtual_layout(spec: BenchSpec, contender: Contender | None) -> VirtualLayout | None:
    """The contender's virtual stages (None: one stage per rank, or a torch schedule)."""
    if contender is None or contender.is_torch or contender.virtual == 1:
        return None
    return VirtualLayout(spec.pp, contender.virtual, contender.placement)


def iteration_work(
    spec: BenchSpec,
    var: Variability,
    cost: CostModel | None,
    iteration: int,
    features: list[dict] | None,
    split: bool,
    contender: Contender | None = None,
) -> IterationWork:
    """The durations ``contender``'s ranks spent (TaskTimes, with its virtual layout's local
    stage times)."""
    layout = virtual_layout(spec, contender)
    S, M, seed = spec.pp if layout is None else layout.num_stages, spec.mb, spec.seed
    times = TaskTimes(var, seed, split, cost, layout=layout)
    lat_f, lat_b = times.latencies(iteration, S, M)
    if layout is None:
        return IterationWork(
            times.realized(iteration, S, M, features), lat_f, lat_b, split, spec.unit_ms / 1000
        )
    for g in range(S - 1):
        if layout.is_local(g, g + 1):  # the V turn sends nothing
            lat_f[g] = lat_b[g + 1] = 0.0
    return IterationWork(
        times.realized(iteration, S, M, features),
        lat_f,
        lat_b,
        split,
        spec.unit_ms / 1000,
        tuple(layout.rank_of(g) for g in range(S)),
    )


def simulated_s(
    spec: BenchSpec,
    var: Variability,
    cost: CostModel | None,
    contender: Contender,
    iteration: int,
    work: IterationWork,
    features: list[dict] | None,
    plan_order: list[int] | None = None,
) -> float | None:
    """The simulator's time for this rrfp contender on the same durations (None for torch's
    schedules). A planned hint is planned again here from the same inputs: the planner is
    deterministic, so it is the plan the ranks followed (``plan_order``, theirs, is checked; None if
    it differs)."""
    if contender.is_torch:
        return None
    hint, dispatch, budget = (
        resolve(contender.hint),
        Dispatch.parse(contender.dispatch),
        Budget.parse(spec.budget),
    )
    layout = virtual_layout(spec, contender)
    if hint.planned:
        hint, made = plan_iteration(
            TaskTimes(var, spec.seed, work.split, cost, layout=layout),
            iteration,
            spec.pp,
            spec.mb,
            budget,
            dispatch,
            features,
        )
        if plan_order is not None and list(made.order) != list(plan_order):
            log.warning(
                "%s iteration %d: the ranks planned %s, the parent %s: not simulated",
                contender.name,
                iteration,
                plan_order,
                list(made.order),
            )
            return None
    cfg = SimConfig(
        spec.pp,
        spec.mb,
        hint,
        dispatch,
        budget,
        var,
        seed=spec.seed,
        iteration=iteration,
        split=work.split,
        durations=work.durations.tolist(),
        virtual=contender.virtual,
        placement=contender.placement,
    )
    return simulate(cfg).makespan * work.unit_s


def annotate(
    spec: BenchSpec,
    case: Case,
    var: Variability,
    cost: CostModel | None,
    rows: list[dict],
    iterations: list[dict],
) -> None:
    """Add ``lower_bound_s``, ``efficiency`` and ``simulated_s`` to every row, in place."""
    feats = {it["iteration"]: it["features"] for it in iterations}
    contenders = {c.name: c for c in case.contenders}
    works: dict[tuple[int, bool], IterationWork] = {}
    for r in rows:
        contender, it = contenders[r["contender"]], r["iteration"]
        features = feats.get(it) if cost else None
        key = (it, contender.split, virtual_layout(spec, contender))
        if key not in works:
            works[key] = iteration_work(spec, var, cost, it, features, contender.split, contender)
        work = works[key]
        r["lower_bound_s"] = work.lower_bound_s
        r["efficiency"] = work.lower_bound_s / r["wall_s"]
        r["simulated_s"] = simulated_s(
            spec, var, cost, contender, it, work, features, r.get("plan_order")
        )


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high}


@dataclass(frozen=True)
class Summary:
    """One contender on one workload, over its measured iterations."""

    contender: str
    iterations: int
    wall_s: Spread
    speedup: Spread | None  # fixed 1F1B's time / this one's, per iteration
    efficiency: Spread
    vs_simulated: Spread | None  # measured / simulated - 1
    peak_inflight: (
        float | None
    )  # microbatches one stage held at once (the max over ranks and iterations)
    decision_us: float | None
    plan_s: float | None
    plan_waited_s: float | None
    overhead_s: Spread | None = (
        None  # drop-in: the step's time outside the executor's iteration and plan
    )

    def as_dict(self) -> dict:
        doc = {
            k: getattr(self, k)
            for k in (
                "contender",
                "iterations",
                "peak_inflight",
                "decision_us",
                "plan_s",
                "plan_waited_s",
            )
        }
        for k in ("wall_s", "speedup", "efficiency", "vs_simulated", "overhead_s"):
            doc[k] = None if getattr(self, k) is None else getattr(self, k).as_dict()
        return doc


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _paired(rows: list[dict], first: str, second: str) -> list[tuple[float, float]]:
    """Both contenders' times, iteration by iteration (both ran it)."""
    a = {r["iteration"]: r["wall_s"] for r in rows if r["contender"] == first}
    b = {r["iteration"]: r["wall_s"] for r in rows if r["contender"] == second}
    return [(a[i], b[i]) for i in sorted(a.keys() & b.keys())]


def paired_ratios(rows: list[dict], numerator: str, denominator: str) -> list[float]:
    """``numerator``'s time over ``denominator``'s, iteration by iteration (both ran it)."""
    return [a / b for a, b in _paired(rows, numerator, denominator)]


def paired_differences(rows: list[dict], first: str, second: str) -> list[float]:
    """``first``'s time minus ``second``'s in seconds, iteration by iteration."""
    return [a - b for a, b in _paired(rows, first, second)]


def summarize(rows: list[dict], contenders: list[str]) -> list[Summary]:
    out = []
    for name in contenders:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        sims = [r["wall_s"] / r["simulated_s"] - 1 for r in mine if r.get("simulated_s")]
        peaks = [r["peak_inflight"] for r in mine if r["peak_inflight"] is not None]
        out.append(
            Summary(
                name,
                len(mine),
                Spread.of([r["wall_s"] for r in mine]),
                Spread.of(paired_ratios(rows, BASELINE, name)),
                Spread.of([r["efficiency"] for r in mine]),
                Spread.of(sims),
                max(peaks) if peaks else None,
                _median([r["decision_us"] for r in mine]),
                _median([r["plan_s"] for r in mine]),
                _median([r.get("plan_waited_s") for r in mine]),
                Spread.of([r["overhead_s"] for r in mine if r.get("overhead_s") is not None]),
            )
        )
    return out
