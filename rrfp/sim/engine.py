"""Discrete-event simulator of one pipeline iteration.

Each stage is a ``StageTracker``, the same state machine the runtime drives.
Tasks take their durations from the variability model and messages their
latency; whenever time is about to move on, every idle stage that something
happened to asks its tracker what to run. The simulator checks what the
runtime promises: each task once, dependencies and latencies respected, the
budget held, no deadlock.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from rrfp.core.bounds import lower_bound
from rrfp.core.budget import Budget
from rrfp.core.durations import TaskTimes
from rrfp.core.hints import Hint, default_split, resolve
from rrfp.core.policy import Dispatch
from rrfp.core.stats import StageStats
from rrfp.core.tasks import Kind, Task
from rrfp.core.tracker import StageTracker
from rrfp.core.variability import Variability
from rrfp.observe.trace import Span
from rrfp.sim.ranked import RankedPipeline, ranking_of


class SimDeadlock(RuntimeError):
    """No stage can run and tasks remain: the executor and hint cannot finish."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated iteration. Strings are accepted here, at the edge, and
    resolved once: ``replace(cfg, hint=...)`` with a resolved Hint costs nothing."""

    stages: int
    microbatches: int
    hint: str | Hint = "1f1b"
    dispatch: Dispatch | str = Dispatch.READY  # the executor: ready or fixed
    budget: Budget | str | int = "2x"
    variability: Variability = field(default_factory=Variability)
    seed: int = 0
    iteration: int = 0
    split: bool | None = None  # None: the hint's default
    mb_bytes: int = 1 << 20  # activation bytes of a mean-size microbatch, for byte budgets
    record: bool = False  # keep the timeline
    durations: Any = None  # [S][M][3] task durations to replay instead of drawing them (rrfp.sim.replay)

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline stages must be >= 1, got {self.stages}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        object.__setattr__(self, "dispatch", Dispatch.parse(self.dispatch))
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "hint", resolve(self.hint))

    @property
    def split_backward(self) -> bool:
        return default_split(self.hint.name, self.split)


@dataclass
class SimResult:
    config: SimConfig
    makespan: float
    stats: list[StageStats]  # per stage, in average-forward units
    lower_bound: float
    timeline: list[tuple[int, Task, float, float]]  # (stage, task, start, end) when recorded

    @property
    def busy(self) -> list[float]:
        return [st.busy for st in self.stats]

    @property
    def peak_inflight(self) -> list[int]:
        return [st.peak_inflight for st in self.stats]

    @property
    def decisions(self) -> int:
        return sum(st.decisions for st in self.stats)

    @property
    def bubble(self) -> list[float]:
        """Per-stage idle fraction of the makespan."""
        return [st.bubble for st in self.stats]

    @property
    def bubble_ratio(self) -> float:
        return float(np.mean(self.bubble))

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0

    def spans(self, process: str) -> list[Span]:
        return [Span(process, s, str(t), a, b) for s, t, a, b in self.timeline]


class TaskDone(NamedTuple):
    stage: int
    task: Task


class Arrival(NamedTuple):
    """The input of F(mb) (kind F) or the gradient for B(mb) (kind B) reaches ``stage``."""

    stage: int
    kind: Kind
    mb: int


def _durations(cfg: SimConfig):
    """dur[s, m, kind], message latencies lat_f/lat_b[s, m] and activation sizes, all drawn at once."""
    S, M, var = cfg.stages, cfg.microbatches, cfg.variability
    times = TaskTimes(var, cfg.seed, cfg.split_backward)
    if cfg.durations is not None:
        dur = np.array(cfg.durations, dtype=np.float64).reshape(S, M, 3)
    else:
        dur = times.realized(cfg.iteration, S, M)
    lat_f, lat_b = times.latencies(cfg.iteration, S, M)
    sizes = (var.length(cfg.seed, cfg.iteration, np.arange(M)) * cfg.mb_bytes).astype(np.int64).tolist()
    return dur, lat_f, lat_b, sizes


def _ranked(cfg: SimConfig, dur, lat_f, lat_b, sizes) -> SimResult | None:
    """The fast path (rrfp.sim.ranked) when it applies and finishes: ready dispatch, a hint
    that ranks every stage alike by one order, one latency per link."""
    S, M, split = cfg.stages, cfg.microbatches, cfg.split_backward
    if cfg.dispatch is not Dispatch.READY or not cfg.hint.uniform or not RankedPipeline.fits(lat_f, lat_b):
        return None
    ranking = ranking_of(cfg.hint.priority(S, 0, M, split), M, split)
    if ranking is None:
        return None
    limits = [cfg.budget.limit(S, s) for s in range(S)]
    run = RankedPipeline(dur, lat_f, lat_b, limits, sizes, split).run(ranking, cfg.record)
    if run is None:
        return None
    stats = [StageStats(busy=run.busy[s], wall=run.makespan, decisions=run.decisions[s],
                        peak_inflight=run.peaks[s], iterations=1) for s in range(S)]
    return SimResult(cfg, run.makespan, stats, lower_bound(dur, lat_f, lat_b, split), run.timeline)


def simulate(cfg: SimConfig, reference: bool = False) -> SimResult:
    """One iteration. Ready dispatch of bf, bfw and plan takes the fast path, which makes the
    trackers' every decision without stepping them; ``reference=True`` always steps them."""
    S, M, split = cfg.stages, cfg.microbatches, cfg.split_backward
    dur, lat_f, lat_b, sizes = _durations(cfg)
    fast = None if reference else _ranked(cfg, dur, lat_f, lat_b, sizes)
    if fast is not None:
        return fast
    D, latency = dur.tolist(), {Kind.F: lat_f.tolist(), Kind.B: lat_b.tolist()}
    trackers = [StageTracker(cfg.hint.spec(S, s, M, split, cfg.dispatch, cfg.budget), sizes.__getitem__)
                for s in range(S)]
    busy, decisions = [0.0] * S, [0] * S
    timeline: list[tuple[int, Task, float, float]] = []
    events: list[tuple[float, int, TaskDone | Arrival]] = []  # (time, sequence, event)
    seq = 0

    def push(time: float, event: TaskDone | Arrival) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, seq, event))

    def dispatch(s: int, now: float) -> None:
        tr = trackers[s]
        task = tr.next()
        decisions[s] += 1
        if task is None:
            return
        tr.start(task)
        end = now + D[s][task.mb][task.kind]
        busy[s] += end - now
        if cfg.record:
            timeline.append((s, task, now, end))
        push(end, TaskDone(s, task))

    for s in range(S):
        dispatch(s, 0.0)
    touched: set[int] = set()
    last = 0.0
    while events:
        now, _, event = heapq.heappop(events)
        if type(event) is TaskDone:
            last = now
            task = event.task
            dest = trackers[event.stage].finish(task)
            if dest is not None:
                push(now + latency[task.kind][event.stage][task.mb], Arrival(dest, task.kind, task.mb))
        else:
            trackers[event.stage].arrive(event.kind, event.mb)
        touched.add(event.stage)
        if not events or events[0][0] > now:  # time moves on: idle stages decide
            for s in sorted(touched):
                if trackers[s].running is None:
                    dispatch(s, now)
            touched.clear()

    if not all(tr.done for tr in trackers):
        left = sum(tr.spec.num_tasks - tr.finished for tr in trackers)
        raise SimDeadlock(f"{cfg.dispatch} executor with hint {cfg.hint.name} stalled with {left} tasks left: "
                          + "; ".join(f"stage {s} {tr.blocked()}" for s, tr in enumerate(trackers)))
    stats = [StageStats(busy=busy[s], wall=last, decisions=decisions[s], peak_inflight=tr.held.peak, iterations=1)
             for s, tr in enumerate(trackers)]
    return SimResult(cfg, last, stats, lower_bound(dur, lat_f, lat_b, split), timeline)
