"""Discrete-event simulator of one pipeline iteration.

Each rank is a ``RankTracker`` over its stages' ``StageTracker``s, the state
machine the runtime drives. Tasks take their durations from the variability
model and messages their latency (the V turn between two stages of one rank
has none); whenever time is about to move on, every idle rank that something
happened to asks its tracker what to run. The simulator checks what the
runtime promises: each task once, dependencies and latencies respected, the
budget held, no deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from rrfp.core.bounds import lower_bound
from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.durations import TaskTimes
from rrfp.core.event_driver import drive
from rrfp.core.hints import DEFAULT_HINT, Hint, default_split, resolve
from rrfp.core.placement import Placement, VirtualLayout
from rrfp.core.policy import DEFAULT_DISPATCH, Dispatch
from rrfp.core.rank_tracker import RankTracker, StageTask
from rrfp.core.stats import StageStats
from rrfp.core.tasks import Kind, Task
from rrfp.core.variability import Variability
from rrfp.observe.trace import Span
from rrfp.sim.ranked import RankedPipeline, ranking_of


class SimDeadlock(RuntimeError):
    """No stage can run and tasks remain: the executor and hint cannot finish."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated iteration. Strings are accepted here, at the edge, and
    resolved once: ``replace(cfg, hint=...)`` with a resolved Hint costs nothing."""

    pp: int  # pipeline ranks (S); with virtual stages the model has S x V stages
    n_microbatches: int
    hint: str | Hint = DEFAULT_HINT
    dispatch: Dispatch | str = DEFAULT_DISPATCH  # ready or fixed
    budget: Budget | str | int = DEFAULT_BUDGET
    variability: Variability = field(default_factory=Variability)
    seed: int = 0
    iteration: int = 0
    split: bool | None = None  # None: the hint's default
    mb_bytes: int = 1 << 20  # activation bytes of a mean-size microbatch, for byte budgets
    record: bool = False  # keep the timeline
    durations: Any = (
        None  # [S*V][M][3] task durations to replay instead of drawing them (rrfp.sim.replay)
    )
    virtual: int = 1  # stages per rank (V)
    placement: Placement | str = Placement.INTERLEAVED

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"pp (pipeline ranks) must be >= 1, got {self.pp}")
        if self.n_microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.n_microbatches}")
        object.__setattr__(self, "dispatch", Dispatch.parse(self.dispatch))
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "hint", resolve(self.hint))
        object.__setattr__(self, "placement", self.layout.placement)

    @property
    def the_hint(self) -> Hint:
        """``hint``, as ``__post_init__`` resolved it."""
        return cast(Hint, self.hint)

    @property
    def the_dispatch(self) -> Dispatch:
        return cast(Dispatch, self.dispatch)

    @property
    def the_budget(self) -> Budget:
        return cast(Budget, self.budget)

    @property
    def split_backward(self) -> bool:
        return default_split(self.the_hint.name, self.split)

    @property
    def layout(self) -> VirtualLayout:
        return VirtualLayout(self.pp, self.virtual, self.placement)

    @property
    def num_stages(self) -> int:
        """Global stages: S x V."""
        return self.pp * self.virtual


@dataclass
class SimResult:
    config: SimConfig
    makespan: float
    stats: list[StageStats]  # per rank, in average-forward units; peaks in local-stage microbatches
    lower_bound: float
    timeline: list[tuple[int, Task, float, float]]  # (global stage, task, start, end) when recorded
    stage_stats: list[StageStats] | None = None  # per global stage: busy time and peak

    @property
    def peak_microbatches(self) -> list[float]:
        """Per rank, the most memory held at once in microbatches of the rank's whole model (1F1B's
        unit: 1x holds S - r); with V = 1 the same as ``peak_inflight``."""
        V = self.config.virtual
        return [st.peak_inflight / V if V > 1 else st.peak_inflight for st in self.stats]

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
        """One row per global stage; with V > 1 each span names its rank."""
        if self.config.virtual == 1:
            return [Span(process, s, str(t), a, b) for s, t, a, b in self.timeline]
        rank_of = self.config.layout.rank_of
        return [
            Span(process, s, str(t), a, b, {"rank": rank_of(s)}) for s, t, a, b in self.timeline
        ]


def _durations(cfg: SimConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """dur[s, m, kind] over global stages, message latencies lat_f/lat_b[s, m] (zero on the V turn,
    which is no message) and one local stage's activation sizes (a microbatch's over V), all drawn
    at once."""
    N, M, V, var = cfg.num_stages, cfg.n_microbatches, cfg.virtual, cfg.variability
    lay = cfg.layout
    times = TaskTimes(var, cfg.seed, cfg.split_backward, layout=lay)
    if cfg.durations is not None:
        dur = np.array(cfg.durations, dtype=np.float64).reshape(N, M, 3)
    else:
        dur = times.realized(cfg.iteration, N, M)
    lat_f, lat_b = times.latencies(cfg.iteration, N, M)
    for s in range(N - 1):
        if lay.is_local(s, s + 1):
            lat_f[s] = 0.0
            lat_b[s + 1] = 0.0
    lengths = var.length(cfg.seed, cfg.iteration, np.arange(M))
    sizes = cast(list[int], (lengths * (cfg.mb_bytes / V)).astype(np.int64).tolist())
    return dur, lat_f, lat_b, sizes


def _ranked(
    cfg: SimConfig, dur: np.ndarray, lat_f: np.ndarray, lat_b: np.ndarray, sizes: list[int]
) -> SimResult | None:
    """The fast path (rrfp.sim.ranked) when it applies and finishes: ready dispatch, a hint
    that ranks every stage alike by one order, one latency per link."""
    S, M, N, split, lay = (
        cfg.pp,
        cfg.n_microbatches,
        cfg.num_stages,
        cfg.split_backward,
        cfg.layout,
    )
    if (
        cfg.dispatch is not Dispatch.READY
        or not cfg.the_hint.uniform
        or not RankedPipeline.fits(lat_f, lat_b)
    ):
        return None
    ranking = ranking_of(cfg.the_hint.priority(N, 0, M, split), M, split)
    if ranking is None:
        return None
    limits = [cfg.the_budget.rank_limit(lay, r) for r in range(S)]
    run = RankedPipeline(dur, lat_f, lat_b, limits, sizes, split, lay).run(ranking, cfg.record)
    if run is None:
        return None
    stats = [
        StageStats(
            busy=run.busy[r],
            wall=run.makespan,
            decisions=run.decisions[r],
            peak_inflight=run.peaks[r],
            iterations=1,
        )
        for r in range(S)
    ]
    per_stage = [
        StageStats(
            busy=run.stage_busy[g],
            wall=run.makespan,
            peak_inflight=run.stage_peaks[g],
            iterations=1,
        )
        for g in range(N)
    ]
    rank_of = [lay.rank_of(g) for g in range(N)]
    return SimResult(
        cfg,
        run.makespan,
        stats,
        lower_bound(dur, lat_f, lat_b, split, rank_of),
        run.timeline,
        per_stage,
    )


def simulate(cfg: SimConfig, reference: bool = False) -> SimResult:
    """One iteration. Ready dispatch of bf, bfw and plan takes the fast path (any V), which makes
    the trackers' every decision without stepping them; ``reference=True`` always steps them."""
    S, M, split, lay = cfg.pp, cfg.n_microbatches, cfg.split_backward, cfg.layout
    dur, lat_f, lat_b, sizes = _durations(cfg)
    fast = None if reference else _ranked(cfg, dur, lat_f, lat_b, sizes)
    if fast is not None:
        return fast
    N = cfg.num_stages
    D, latency = dur.tolist(), {Kind.F: lat_f.tolist(), Kind.B: lat_b.tolist()}
    trackers = [
        RankTracker(
            cfg.the_hint.rank_spec(lay, r, M, split, cfg.the_dispatch, cfg.the_budget),
            sizes.__getitem__,
        )
        for r in range(S)
    ]
    rank_of = [lay.rank_of(s) for s in range(N)]
    busy, decisions, stage_busy = [0.0] * S, [0] * S, [0.0] * N
    timeline: list[tuple[int, Task, float, float]] = []

    def decided(r: int, item: StageTask | None, now: float, end: float) -> None:
        decisions[r] += 1
        if item is not None:
            busy[r] += end - now
            stage_busy[item.stage] += end - now
            if cfg.record:
                timeline.append((item.stage, item.task, now, end))

    last = drive(
        trackers,
        rank_of,
        lambda s, t: D[s][t.mb][t.kind],
        lambda s, t: latency[t.kind][s][t.mb],
        decided,
    )

    if not all(tr.done for tr in trackers):
        left = sum(tr.spec.num_tasks - tr.finished for tr in trackers)
        raise SimDeadlock(
            f"{cfg.dispatch} dispatch with hint {cfg.the_hint.name} stalled with {left} tasks "
            "left: " + "; ".join(f"rank {r} {tr.blocked()}" for r, tr in enumerate(trackers))
        )
    stats = [
        StageStats(
            busy=busy[r],
            wall=last,
            decisions=decisions[r],
            peak_inflight=tr.held.peak,
            iterations=1,
        )
        for r, tr in enumerate(trackers)
    ]
    per_stage = [
        StageStats(
            busy=stage_busy[s],
            wall=last,
            peak_inflight=trackers[rank_of[s]].trackers[s].held.peak,
            iterations=1,
        )
        for s in range(N)
    ]
    return SimResult(
        cfg, last, stats, lower_bound(dur, lat_f, lat_b, split, rank_of), timeline, per_stage
    )
