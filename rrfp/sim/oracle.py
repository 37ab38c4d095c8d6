"""The clairvoyant optimum: the shortest iteration any schedule could reach on
one seed's realized durations, solved with OR-Tools CP-SAT.

Executors decide online; the oracle knows every duration and latency in
advance, so its makespan is what no executor can beat under the same budget.
It tells how much of the gap to the cheap lower bound is left to win.

The model (docs/design.md, "The clairvoyant optimum"): one interval per task,
one no-overlap per stage, the tracker's dependencies with the simulator's
message latencies, and one "held" interval per (stage, microbatch) from the
start of F to the end of the last backward, under a cumulative with the
stage's budget. CP-SAT works in integers: times are multiplied by ``scale``
and rounded down, so the integer optimum is a valid lower bound on the real
one. The best schedule found is replayed by the simulator (fixed dispatch on
its per-stage orders), so ``makespan`` is an achievable, exactly timed
iteration. OR-Tools is an optional extra (``pip install 'rrfp[oracle]'``),
imported only when a solve starts.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from rrfp.core.bounds import lower_bound
from rrfp.core.hints import Hint
from rrfp.core.policy import Dispatch
from rrfp.core.tasks import Kind, Task, last_backward
from rrfp.sim.engine import SimConfig, SimResult, _durations, simulate

log = logging.getLogger(__name__)

INSTALL_HINT = "the optimum needs OR-Tools: pip install 'rrfp[oracle]'"


class OracleUnavailable(ImportError):
    """OR-Tools is not installed."""


@dataclass(frozen=True)
class OracleResult:
    """One solve, in the simulator's time units (average forwards).

    ``bound`` is proven: no schedule under the budget is shorter. ``makespan``
    is the best schedule found (None if none was), exactly timed by the
    simulator. ``optimal`` means CP-SAT proved its integer optimum, so the
    real optimum lies in [bound, makespan], a gap of at most one rounding
    step (1/scale) per task on the critical path."""

    makespan: float | None
    bound: float
    optimal: bool
    seconds: float
    status: str  # CP-SAT's status name: OPTIMAL, FEASIBLE (time limit hit), UNKNOWN, ...
    orders: tuple[tuple[Task, ...], ...] | None = None  # per-stage task order of the best schedule

    @property
    def gap(self) -> float | None:
        """How far the best schedule found may be from the optimum, relative to the bound."""
        return None if self.makespan is None else self.makespan / self.bound - 1 if self.bound > 0 else 0.0

    def as_dict(self) -> dict:
        return {"makespan": self.makespan, "bound": self.bound, "optimal": self.optimal,
                "seconds": self.seconds, "status": self.status}


def require_ortools():
    """CP-SAT's module, or OracleUnavailable naming the extra to install."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise OracleUnavailable(INSTALL_HINT) from None
    return cp_model


def _kinds(split: bool) -> tuple[Kind, ...]:
    return (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)


def as_split(order: Sequence[Task], split: bool) -> list[Task]:
    """A stage's order for a split backward: an unsplit B(m) becomes B(m) then W(m)."""
    if not split or any(t.kind is Kind.W for t in order):
        return list(order)
    return [x for t in order for x in ((t, Task(Kind.W, t.mb)) if t.kind is Kind.B else (t,))]


def solve(cfg: SimConfig, time_limit: float = 10.0, workers: int = 2, scale: int = 1000,
          hints: Iterable[SimResult] = ()) -> OracleResult:
    """Minimum makespan of ``cfg``'s iteration (its S, M, split, budget and
    seed's durations); hint, dispatch and executor of ``cfg`` are ignored.

    ``hints``: recorded simulations on the same durations whose schedules
    hold the budget (ready dispatch does by construction); the shortest one
    is the solver's first incumbent. ``time_limit`` is wall seconds; a solve
    that hits it reports its best schedule and proven bound, not an optimum.
    ``workers`` is fixed so that a solve that finishes is reproducible."""
    cp_model = require_ortools()
    S, M, split = cfg.stages, cfg.microbatches, cfg.split_backward
    dur, lat_f, lat_b, sizes = _durations(cfg)
    kinds = _kinds(split)
    d = np.floor(dur * scale).astype(np.int64)  # rounded down: the integer optimum stays a lower bound
    lf, lb = np.floor(lat_f * scale).astype(np.int64), np.floor(lat_b * scale).astype(np.int64)
    horizon = int(d.sum() + lf.sum() + lb.sum()) + 1  # running everything one after another fits

    model = cp_model.CpModel()
    start = {(s, m, k): model.new_int_var(0, horizon, f"start_{k.name}{m}_s{s}")
             for s in range(S) for m in range(M) for k in kinds}
    end = {key: v + int(d[key[0], key[1], key[2]]) for key, v in start.items()}
    for s in range(S):
        model.add_no_overlap([model.new_fixed_size_interval_var(start[s, m, k], int(d[s, m, k]), f"{k.name}{m}_s{s}")
                              for m in range(M) for k in kinds])
        for m in range(M):
            if s > 0:  # F needs its input: the previous stage's F and the message's latency
                model.add(start[s, m, Kind.F] >= end[s - 1, m, Kind.F] + int(lf[s - 1, m]))
            model.add(start[s, m, Kind.B] >= end[s, m, Kind.F])
            if s < S - 1:  # B needs the gradient from the next stage's B
                model.add(start[s, m, Kind.B] >= end[s + 1, m, Kind.B] + int(lb[s + 1, m]))
            if split:
                model.add(start[s, m, Kind.W] >= end[s, m, Kind.B])
        _budget(model, cfg, s, start, end, sizes, split, horizon)
    makespan = model.new_int_var(0, horizon, "makespan")
    for key, e in end.items():
        model.add(makespan >= e)
    model.minimize(makespan)

    hinted = _best_hint(hints, dur, split)
    if hinted is not None:
        for (s, m, k), v in start.items():
            model.add_hint(v, int(np.floor(hinted[1][s, m, k] * scale)))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = 0
    t0 = time.perf_counter()
    status = solver.solve(model)
    seconds = time.perf_counter() - t0
    name = solver.status_name(status)
    cheap = lower_bound(dur, lat_f, lat_b, split)
    if status == cp_model.INFEASIBLE or status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"oracle model is {name} for S={S} M={M} budget {cfg.budget}: a bug in the model")
    bound = max(solver.best_objective_bound / scale, cheap)  # both are proven; keep the tighter
    best: tuple[float, tuple[tuple[Task, ...], ...]] | None = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        orders = tuple(tuple(Task(k, m) for _, k, m in sorted((solver.value(start[s, m, k]), k, m)
                                                               for m in range(M) for k in kinds))
                       for s in range(S))
        best = (replay(cfg, orders).makespan, orders)
    if hinted is not None and (best is None or hinted[0] < best[0]):
        best = (hinted[0], hinted[2])  # rounding can make the solver's pick a hair longer in real time
    log.info("oracle S=%d M=%d seed=%d: %s in %.2f s, makespan %s, bound %.4f", S, M, cfg.seed, name, seconds,
             None if best is None else f"{best[0]:.4f}", bound)
    return OracleResult(None if best is None else best[0], bound, status == cp_model.OPTIMAL, seconds, name,
                        None if best is None else best[1])


def _budget(model, cfg: SimConfig, s: int, start, end, sizes: list[int], split: bool, horizon: int) -> None:
    """The tracker's in-flight rule on stage ``s``: microbatch m is held from
    the start of F(m) to the end of its last backward, and a stage holds at
    most its count, or its bytes (a microbatch larger than the byte limit is
    held alone)."""
    limit = cfg.budget.limit(cfg.stages, s)
    M, last = cfg.microbatches, last_backward(split)
    if limit.count is None and limit.bytes is None:
        return
    held = []
    for m in range(M):
        size = model.new_int_var(0, horizon, f"held{m}_s{s}")
        held.append(model.new_interval_var(start[s, m, Kind.F], size, end[s, m, last], f"held{m}_s{s}"))
    if limit.count is not None and limit.count < M:
        model.add_cumulative(held, [1] * M, limit.count)
    if limit.bytes is not None:
        demand = [min(int(sizes[m]), limit.bytes) for m in range(M)]
        if sum(demand) > limit.bytes:
            model.add_cumulative(held, demand, limit.bytes)


def _best_hint(results: Iterable[SimResult], dur: np.ndarray, split: bool):
    """(makespan, starts[s, m, k], orders) of the shortest recorded result. An
    unsplit result becomes a split schedule: W(m) right after B(m), whose split
    duration is ``dur[s, m, B]``."""
    best = None
    for r in results:
        if not r.timeline:
            raise ValueError("an oracle hint must be a recorded simulation (SimConfig(record=True))")
        if best is None or r.makespan < best.makespan:
            best = r
    if best is None:
        return None
    unsplit = split and not best.config.split_backward
    starts = np.zeros(dur.shape)
    per_stage: list[list[tuple[float, Task]]] = [[] for _ in range(best.config.stages)]
    for s, task, a, _ in best.timeline:
        starts[s, task.mb, task.kind] = a
        if unsplit and task.kind is Kind.B:
            starts[s, task.mb, Kind.W] = a + dur[s, task.mb, Kind.B]
        per_stage[s].append((a, task))
    orders = tuple(tuple(as_split([t for _, t in sorted(ts, key=lambda x: (x[0], x[1].kind))], split))
                   for ts in per_stage)
    return best.makespan, starts, orders


def replay(cfg: SimConfig, orders: Sequence[Sequence[Task]]) -> SimResult:
    """The simulator running ``orders`` as a fixed order on ``cfg``'s durations:
    the earliest timing of that schedule, checked by the same tracker rules."""
    frozen = tuple(tuple(o) for o in orders)
    hint = Hint("oracle", lambda S, s, M, split: frozen[s])
    return simulate(replace(cfg, hint=hint, dispatch=Dispatch.FIXED, record=False))
