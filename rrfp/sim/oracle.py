"""The clairvoyant optimum: the shortest iteration any schedule could reach on
one seed's realized durations, solved with OR-Tools CP-SAT.

Executors decide online; the oracle knows every duration and latency in
advance, so its makespan is what no executor can beat under the same budget.
It tells how much of the gap to the cheap lower bound is left to win.

The model (docs/simulator.md, "The clairvoyant optimum"): one interval per task
of every global stage, one no-overlap per rank over all its stages' tasks (a
rank runs one task at a time; with V = 1 a rank is a stage), the tracker's
dependencies with the simulator's message latencies (none on the V turn
between two stages of one rank), and one "held" interval per (stage,
microbatch) from the start of F to the end of the last backward, under a
cumulative per rank with the rank's limit (``Budget.rank_limit``: local-stage
microbatches over all its stages; bytes, as below). CP-SAT works in integers: times
are multiplied by ``scale`` and rounded down, so the integer optimum is a
valid lower bound on the real one. The best schedule found is replayed by the
simulator (fixed dispatch on its per-rank orders of (stage, task) pairs), so
``makespan`` is an achievable, exactly timed iteration. OR-Tools is an optional
extra (``pip install 'rrfp[oracle]'``), imported only when a solve starts.

With V > 1 the runtime's rank tracker adds two policy devices the model
leaves out: room reserved for later local stages' forwards (an F on local
stage c needs V-1-c units free after it) and a bound on how far local stage
c's forwards lead local stage c + 1's. Both only forbid schedules, so the
optimum without them is a relaxation of what ready dispatch may do under
the same count budget: still a valid lower bound on it. A byte budget at V > 1
is not a cap at the limit: the tracker lets a forward with nothing held at its
local stage or later start past the bytes, so a rank may hold up to V - 1
local-stage microbatches more. The model caps what it provably holds instead
(``byte_caps``): what local stages 0..c of a rank hold, each microbatch
counted at min(size, limit), at most limit + c * the largest, for every c.
Every ready schedule holds these, so the optimum stays a floor under it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from rrfp.core.bounds import lower_bound
from rrfp.core.budget import Budget, Limit, peak_held
from rrfp.core.hints import Hint
from rrfp.core.policy import Dispatch
from rrfp.core.tasks import Kind, Task, last_backward
from rrfp.sim.engine import SimConfig, SimDeadlock, SimResult, _durations, simulate

if TYPE_CHECKING:
    from ortools.sat.python import cp_model as cp

log = logging.getLogger(__name__)

# per rank, over its (stage, task) pairs (with V = 1, its one stage's tasks)
Orders: TypeAlias = tuple[tuple[tuple[int, Task], ...], ...]
AnyOrders: TypeAlias = Sequence[Sequence[tuple[int, Task]]]
TaskKey: TypeAlias = tuple[int, int, Kind]  # (global stage, microbatch, kind)

INSTALL_HINT = "the optimum needs OR-Tools: pip install 'rrfp[oracle]'"
RELAXED_SHARE = 0.5  # of the time limit, for the solve without the budget when the budget can bind


class OracleUnavailable(ImportError):
    """OR-Tools is not installed."""


@dataclass(frozen=True)
class OracleResult:
    """One solve, in the simulator's time units (average forwards).

    ``bound`` is proven: no schedule under the budget is shorter. ``makespan``
    is the best schedule found (None if none was), exactly timed by the
    simulator. ``optimal`` means CP-SAT proved its integer optimum, so the
    real optimum lies in [bound, makespan], a gap of at most one rounding
    step (1/scale) per task and message on the critical path; or that the
    best schedule meets the proven bound."""

    makespan: float | None
    bound: float
    optimal: bool
    seconds: float
    status: str  # CP-SAT's status name: OPTIMAL, FEASIBLE (time limit hit), UNKNOWN, ...
    # The best schedule's order: per rank, over its (stage, task) pairs.
    orders: Orders | None = None

    @property
    def gap(self) -> float | None:
        """How far the best schedule found may be from the optimum, relative to the bound."""
        if self.makespan is None:
            return None
        return self.makespan / self.bound - 1 if self.bound > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "makespan": self.makespan,
            "bound": self.bound,
            "optimal": self.optimal,
            "seconds": self.seconds,
            "status": self.status,
        }


def require_ortools() -> ModuleType:
    """CP-SAT's module, or OracleUnavailable naming the extra to install."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise OracleUnavailable(INSTALL_HINT) from None
    return cp_model


@dataclass(frozen=True)
class _Instance:
    """One iteration in CP-SAT's integers: every time multiplied by ``scale`` and rounded down."""

    cfg: SimConfig
    kinds: tuple[Kind, ...]
    # real durations [S*V, M, 3] over global stages, as the simulator draws them
    dur: npt.NDArray[np.float64]
    d: npt.NDArray[np.int64]  # integer durations
    lf: npt.NDArray[np.int64]  # integer latency of F(s, m)'s message to s + 1 (0 on the V turn)
    lb: npt.NDArray[np.int64]  # integer latency of B(s, m)'s message to s - 1 (0 on the V turn)
    sizes: list[int]
    horizon: int
    scale: int
    cheap_bound: float  # rrfp.core.bounds.lower_bound on the real durations


def _instance(cfg: SimConfig, scale: int) -> _Instance:
    dur, lat_f, lat_b, sizes = _durations(cfg)
    d = np.floor(dur * scale).astype(np.int64)  # rounded down: the integer optimum stays a bound
    lf, lb = np.floor(lat_f * scale).astype(np.int64), np.floor(lat_b * scale).astype(np.int64)
    horizon = int(d.sum() + lf.sum() + lb.sum()) + 1  # running everything one after another fits
    split = cfg.split_backward
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    rank_of = [cfg.layout.rank_of(g) for g in range(cfg.num_stages)]
    return _Instance(
        cfg,
        kinds,
        dur,
        d,
        lf,
        lb,
        sizes,
        horizon,
        scale,
        lower_bound(dur, lat_f, lat_b, split, rank_of),
    )


def _limit(cfg: SimConfig, rank: int) -> Limit:
    """The budget on ``rank`` over all its stages (a stage's own limit with V = 1)."""
    return Budget.parse(cfg.budget).rank_limit(cfg.layout, rank)


def as_split(order: Sequence[Task], split: bool) -> list[Task]:
    """A stage's order for a split backward: an unsplit B(m) becomes B(m) then W(m)."""
    if not split or any(t.kind is Kind.W for t in order):
        return list(order)
    return [x for t in order for x in ((t, Task(Kind.W, t.mb)) if t.kind is Kind.B else (t,))]


def as_split_pairs(order: Sequence[tuple[int, Task]], split: bool) -> list[tuple[int, Task]]:
    """A rank's order over (stage, task) pairs for a split backward: B(m) of a stage, then its
    W(m)."""
    if not split or any(t.kind is Kind.W for _, t in order):
        return list(order)
    return [(s, x) for s, t in order for x in as_split([t], split)]


def solve(
    cfg: SimConfig,
    time_limit: float = 10.0,
    threads: int = 2,
    scale: int = 1000,
    hints: Iterable[SimResult] = (),
    params: Mapping[str, object] | None = None,
) -> OracleResult:
    """Minimum makespan of ``cfg``'s iteration (its S, M, V and placement, split,
    budget and seed's durations); hint and dispatch of ``cfg`` are ignored.

    ``hints``: recorded simulations on the same durations whose schedules
    hold the budget (ready dispatch does by construction); the shortest one
    is the solver's first incumbent (split ones are skipped when ``cfg``
    keeps B whole; unsplit ones become split with W right after B). When the
    budget can bind, the problem without it is solved first, for up to half
    the time: its bound is a bound of the real problem, and its schedule (or
    ready dispatch following its order under the budget) is one more
    incumbent.

    ``time_limit`` is wall seconds for everything; a solve that hits it
    reports its best schedule and proven bound, not an optimum. ``threads``
    is CP-SAT's thread count, fixed: a proven optimum does not depend on it
    or on the machine, while what a timed-out solve reaches does. ``params``
    sets further CP-SAT parameters by name."""
    cp_model = require_ortools()
    cfg = replace(cfg, split=cfg.split_backward)  # the replay's hint must not change the split
    inst = _instance(cfg, scale)
    t0 = time.perf_counter()
    candidates = _usable(hints, cfg)
    lower = 0
    if _budget_can_bind(inst):
        relaxed = _run(
            cp_model,
            inst,
            False,
            0,
            _best_hint(candidates),
            RELAXED_SHARE * time_limit,
            threads,
            params,
        )
        lower = relaxed.bound
        if relaxed.orders is not None:
            as_is = replay(cfg, relaxed.orders, record=True)
            if holds_budget(cfg, as_is):
                # the optimum without the budget holds it: nothing can be shorter
                if relaxed.optimal:
                    return _result(inst, relaxed, as_is, [], time.perf_counter() - t0)
                candidates.append(as_is)
            elif (repaired := _repair(cfg, relaxed.orders)) is not None:
                candidates.append(repaired)
    left = max(0.0, time_limit - (time.perf_counter() - t0))
    hint = _best_hint(candidates)
    main = _run(cp_model, inst, True, lower, hint, left, threads, params)
    best = replay(cfg, main.orders, record=False) if main.orders is not None else None
    return _result(inst, main, best, candidates, time.perf_counter() - t0)


@dataclass(frozen=True)
class _Solve:
    status: str
    optimal: bool
    bound: int  # proven, in integer units
    orders: Orders | None  # the best solution's order, per rank over (stage, task) pairs


def _run(
    cp_model: ModuleType,
    inst: _Instance,
    with_budget: bool,
    lower: int,
    hint: SimResult | None,
    seconds: float,
    threads: int,
    params: Mapping[str, object] | None,
) -> _Solve:
    """One CP-SAT solve of ``inst``, with or without the budget, its makespan at least ``lower``."""
    cfg = inst.cfg
    S, M, N, split, d, kinds = (
        cfg.pp,
        cfg.n_microbatches,
        cfg.num_stages,
        cfg.split_backward,
        inst.d,
        inst.kinds,
    )
    lay = cfg.layout
    model = cp_model.CpModel()
    start = {
        (s, m, k): model.new_int_var(0, inst.horizon, f"start_{k.name}{m}_s{s}")
        for s in range(N)
        for m in range(M)
        for k in kinds
    }
    end = {key: v + int(d[key]) for key, v in start.items()}
    for r in range(S):
        stages = lay.stages_of(r)
        model.add_no_overlap(
            [
                model.new_fixed_size_interval_var(
                    start[s, m, k], int(d[s, m, k]), f"{k.name}{m}_s{s}"
                )
                for s in stages
                for m in range(M)
                for k in kinds
            ]
        )
        for s in stages:
            for m in range(M):
                if s > 0:  # F needs its input: the previous stage's F and the message's latency
                    model.add(start[s, m, Kind.F] >= end[s - 1, m, Kind.F] + int(inst.lf[s - 1, m]))
                model.add(start[s, m, Kind.B] >= end[s, m, Kind.F])
                if s < N - 1:  # B needs the gradient from the next stage's B
                    model.add(start[s, m, Kind.B] >= end[s + 1, m, Kind.B] + int(inst.lb[s + 1, m]))
                if split:
                    model.add(start[s, m, Kind.W] >= end[s, m, Kind.B])
        if with_budget:
            _budget(model, inst, r, start, end)
    makespan = model.new_int_var(lower, inst.horizon, "makespan")
    for e in end.values():
        model.add(makespan >= e)
    model.minimize(makespan)
    if hint is not None:
        starts = _hint_starts(hint, inst)
        for key, v in start.items():
            model.add_hint(v, int(starts[key]))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(seconds))
    solver.parameters.num_workers = int(threads)
    solver.parameters.random_seed = 0
    for param, value in (params or {}).items():
        setattr(solver.parameters, param, value)
    status = solver.solve(model)
    name = solver.status_name(status)
    if status in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID):
        raise RuntimeError(
            f"oracle model is {name} for S={S} V={cfg.virtual} M={M} budget {cfg.budget}: "
            "a bug in the model"
        )
    orders: Orders | None = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # ties (tasks floored to no time) in dependency order: F up the stages, B down, F < B < W
        orders = tuple(
            tuple(
                (s, Task(k, m))
                for *_, s, k, m in sorted(
                    (solver.value(start[s, m, k]), k, s if k is Kind.F else -s, m, s, k, m)
                    for s in lay.stages_of(r)
                    for m in range(M)
                    for k in kinds
                )
            )
            for r in range(S)
        )
    return _Solve(
        name,
        status == cp_model.OPTIMAL,
        max(lower, int(np.floor(solver.best_objective_bound))),
        orders,
    )


def _result(
    inst: _Instance,
    solved: _Solve,
    best: SimResult | None,
    candidates: list[SimResult],
    seconds: float,
) -> OracleResult:
    """The shortest of the solver's schedule and the incumbents: rounding can
    make the solver's pick a hair longer in real time than a hint it started from."""
    pool = [r for r in [best, *candidates] if r is not None]
    top = min(pool, key=lambda r: r.makespan) if pool else None
    orders = (
        None
        if top is None
        else solved.orders
        if top is best
        else _orders(top, inst.cfg.split_backward)
    )
    bound = max(solved.bound / inst.scale, inst.cheap_bound)  # both are proven; keep the tighter
    # a schedule that meets the bound is optimal too
    optimal = solved.optimal or (top is not None and top.makespan <= bound + 1e-9)
    cfg = inst.cfg
    log.info(
        "oracle S=%d V=%d M=%d seed=%d: %s in %.2f s, makespan %s, bound %.4f",
        cfg.pp,
        cfg.virtual,
        cfg.n_microbatches,
        cfg.seed,
        solved.status,
        seconds,
        None if top is None else f"{top.makespan:.4f}",
        bound,
    )
    return OracleResult(
        None if top is None else top.makespan, bound, optimal, seconds, solved.status, orders
    )


def byte_caps(virtual: int, limit: int, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """What a rank's tracker provably holds under a byte ``limit`` (rrfp.core.rank_tracker): each
    microbatch at a local stage counted at min(size, limit), and ``caps[c]`` on its local stages
    0..c together.

    An F admitted with something held at its local stage or later leaves at most the limit on the
    rank; one admitted with nothing there adds one local-stage microbatch to what local stages
    before it hold. By induction local stages 0..c hold at most limit + c * (the largest counted
    local-stage microbatch). With V = 1 that is the stage's rule exactly (a microbatch larger than
    the limit is held alone); with V > 1 it is the simplest bound the tracker guarantees, looser
    than its rule, so a relaxation of it."""
    demand = [min(int(x), limit) for x in sizes]
    largest = max(demand, default=0)
    return demand, [limit + c * largest for c in range(virtual)]


def _budget_can_bind(inst: _Instance) -> bool:
    """Whether some rank's limit is below what its stages would hold with every microbatch in
    flight."""
    cfg = inst.cfg
    held = cfg.virtual * cfg.n_microbatches  # (stage, microbatch) pairs a rank holds at most
    for r in range(cfg.pp):
        limit = _limit(cfg, r)
        if limit.count is not None and limit.count < held:
            return True
        if limit.bytes is not None:
            demand, caps = byte_caps(cfg.virtual, limit.bytes, inst.sizes)
            if any((c + 1) * sum(demand) > cap for c, cap in enumerate(caps)):
                return True
    return False


def _budget(
    model: cp.CpModel,
    inst: _Instance,
    rank: int,
    start: Mapping[TaskKey, cp.IntVar],
    end: Mapping[TaskKey, cp.LinearExprT],
) -> None:
    """The tracker's in-flight rule on ``rank``: (stage, microbatch) is held
    from the start of F to the end of its last backward, and the rank's stages
    together hold at most its count of local-stage microbatches; by bytes, its local stages 0..c
    hold at most ``byte_caps``'s c-th cap (a microbatch larger than the limit counts as the
    limit). With V = 1 that is the stage's rule."""
    cfg = inst.cfg
    limit = _limit(cfg, rank)
    M, last = cfg.n_microbatches, last_backward(cfg.split_backward)
    stages = cfg.layout.stages_of(rank)  # in local-stage order, as the rank tracker numbers them
    held = [
        model.new_interval_var(
            start[s, m, Kind.F],
            model.new_int_var(0, inst.horizon, f"held{m}_s{s}"),
            end[s, m, last],
            f"held{m}_s{s}",
        )
        for s in stages
        for m in range(M)
    ]
    if limit.count is not None and limit.count < len(held):
        model.add_cumulative(held, [1] * len(held), limit.count)
    if limit.bytes is not None:
        demand, caps = byte_caps(cfg.virtual, limit.bytes, inst.sizes)
        for c, cap in enumerate(caps):
            if (c + 1) * sum(demand) > cap:
                model.add_cumulative(held[: (c + 1) * M], demand * (c + 1), cap)


def holds_budget(cfg: SimConfig, result: SimResult) -> bool | None:
    """Whether a schedule is one of the optimum's problem: it held ``cfg``'s count
    budget on every rank (every stage with V = 1; local-stage microbatches over a rank's
    stages with V > 1, as ``Budget.rank_limit`` counts them), or by bytes
    ``byte_caps`` on every rank (the limit itself with V = 1). None for a byte
    budget and a result not recorded, whose peak count cannot tell."""
    budget = Budget.parse(cfg.budget)
    if budget.bytes is None:
        return all(p <= _count(_limit(cfg, r)) for r, p in enumerate(result.peak_inflight))
    if not result.timeline:
        return None
    last = last_backward(result.config.split_backward)
    demand, caps = byte_caps(cfg.virtual, budget.bytes, _durations(cfg)[3])
    # (stage, mb) -> [start of F, end of its last backward]
    held: dict[tuple[int, int], list[float]] = {}
    for s, task, a, b in result.timeline:
        if task.kind is Kind.F:
            held.setdefault((s, task.mb), [a, b])[0] = a
        if task.kind is last:
            held.setdefault((s, task.mb), [a, b])[1] = b
    for r in range(cfg.pp):
        stages = cfg.layout.stages_of(r)
        for c, cap in enumerate(caps):
            spans = [(a, b, demand[m]) for (s, m), (a, b) in held.items() if s in stages[: c + 1]]
            if peak_held(spans) > cap:
                return False
    return True


def _count(limit: Limit) -> int:
    """A count limit's count (a budget without bytes has one)."""
    assert limit.count is not None
    return limit.count


def _order_hint(orders: AnyOrders) -> Hint:
    """``orders``, per rank over (stage, task) pairs, as the hint fixed dispatch follows and ready
    dispatch ranks by."""
    return Hint("oracle", _no_rule, fixed_rank_orders=tuple(tuple(o) for o in orders))


def _no_rule(S: int, s: int, M: int, split: bool) -> list[Task]:
    raise ValueError("the oracle's hint is its fixed order, per rank")


def _repair(cfg: SimConfig, orders: AnyOrders) -> SimResult | None:
    """Ready dispatch under ``cfg``'s budget with ``orders`` as its priority: a schedule that
    holds it."""
    try:
        return simulate(
            replace(cfg, hint=_order_hint(orders), dispatch=Dispatch.READY, record=True)
        )
    except SimDeadlock:
        return None


def _orders(result: SimResult, split: bool) -> Orders:
    """The order ``result`` started its tasks in, per rank over (stage, task) pairs, as a split
    schedule if ``split``. Tasks of no time that start together keep F < B < W, the order their
    dependencies allow, and otherwise the order they were decided in."""
    cfg = result.config
    per_rank: list[list[tuple[float, int, Task]]] = [[] for _ in range(cfg.pp)]
    for s, task, a, _ in result.timeline:
        per_rank[cfg.layout.rank_of(s)].append((a, s, task))
    return tuple(
        tuple(
            as_split_pairs(
                [(s, t) for a, s, t in sorted(ts, key=lambda x: (x[0], x[2].kind))], split
            )
        )
        for ts in per_rank
    )


def _hint_starts(result: SimResult, inst: _Instance) -> npt.NDArray[np.int64]:
    """Start times [S*V, M, 3] of a recorded schedule in integer units, rounded
    down, which keeps it feasible in the rounded model. An unsplit schedule
    becomes a split one: W(m) right after B(m)."""
    unsplit = inst.cfg.split_backward and not result.config.split_backward
    starts = np.zeros(inst.dur.shape)
    for s, task, a, _ in result.timeline:
        starts[s, task.mb, task.kind] = a
        if unsplit and task.kind is Kind.B:
            starts[s, task.mb, Kind.W] = a + inst.dur[s, task.mb, Kind.B]
    return np.floor(starts * inst.scale).astype(np.int64)


def _usable(results: Iterable[SimResult], cfg: SimConfig) -> list[SimResult]:
    """Recorded results that are schedules of the problem: a split schedule is none when B stays
    whole."""
    out = []
    for r in results:
        if not r.timeline:
            raise ValueError(
                "an oracle hint must be a recorded simulation (SimConfig(record=True))"
            )
        if r.config.layout != cfg.layout:
            raise ValueError(
                f"an oracle hint must run the solved layout ({cfg.layout.describe()}), "
                f"not {r.config.layout.describe()}"
            )
        if cfg.split_backward or not r.config.split_backward:
            out.append(r)
    return out


def _best_hint(results: list[SimResult]) -> SimResult | None:
    """The shortest recorded result: the solver's first incumbent."""
    return min(results, key=lambda r: r.makespan, default=None)


def replay(cfg: SimConfig, orders: AnyOrders, record: bool = False) -> SimResult:
    """The simulator running ``orders`` (per rank, over (stage, task) pairs) as a fixed order on
    ``cfg``'s durations: the earliest timing of that schedule, checked by the same tracker rules."""
    return simulate(
        replace(
            cfg,
            hint=_order_hint(orders),
            dispatch=Dispatch.FIXED,
            record=record,
            split=cfg.split_backward,
        )
    )
