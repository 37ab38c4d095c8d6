"""Discrete-event simulator of one pipeline iteration.

Stages run tasks with durations from the variability model; messages take
their latency; every stage that is idle asks the one policy function what to
run. The simulator checks what the runtime promises: each task once,
dependencies and latencies respected, the budget held, no deadlock.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from ..bounds import lower_bound
from ..budget import Budget
from ..hints import Hint, default_split, resolve
from ..policy import Executor, Limit, StageState, choose
from ..tasks import Kind, Task
from ..trace import Span
from ..variability import Variability


class SimDeadlock(RuntimeError):
    """No stage can run and tasks remain: the executor and hint cannot finish."""


@dataclass(frozen=True)
class SimConfig:
    stages: int
    microbatches: int
    hint: str | Hint = "1f1b"
    executor: Executor | str = Executor.READY
    budget: Budget | str | int = "2x"
    variability: Variability = field(default_factory=Variability)
    seed: int = 0
    iteration: int = 0
    split: bool | None = None  # None: the hint's default
    mb_bytes: int = 1 << 20  # activation bytes of a mean-size microbatch, for byte budgets
    record: bool = False  # keep the timeline

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline stages must be >= 1, got {self.stages}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        object.__setattr__(self, "executor", Executor(self.executor))
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "hint", resolve(self.hint))

    @property
    def split_backward(self) -> bool:
        return default_split(self.hint.name) if self.split is None else self.split


@dataclass
class SimResult:
    config: SimConfig
    makespan: float
    busy: list[float]
    peak_inflight: list[int]
    lower_bound: float
    decisions: int
    timeline: list[tuple[int, Task, float, float]]  # (stage, task, start, end) when recorded

    @property
    def bubble(self) -> list[float]:
        """Per-stage idle fraction of the makespan."""
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        return float(np.mean(self.bubble))

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0

    def spans(self, process: str) -> list[Span]:
        return [Span(process, s, str(t), a, b) for s, t, a, b in self.timeline]


class _Ready:
    """A stage's dependency-ready tasks: one heap per kind keyed by rank, plus
    flags for membership. Iteration yields the heads, as the policy allows."""

    __slots__ = ("heaps", "flags", "tasks")

    def __init__(self, M: int, tasks: list[list[Task]]):
        self.heaps: list[list[tuple[int, int]]] = [[], [], []]
        self.flags = [bytearray(M), bytearray(M), bytearray(M)]
        self.tasks = tasks

    def add(self, kind: int, mb: int, rank: int) -> None:
        self.flags[kind][mb] = 1
        heapq.heappush(self.heaps[kind], (rank, mb))

    def remove(self, task: Task) -> None:
        k = int(task.kind)
        self.flags[k][task.mb] = 0
        heap = self.heaps[k]
        if heap and heap[0][1] == task.mb:
            heapq.heappop(heap)
        else:  # fixed executor takes from anywhere; drop lazily
            self._drop_stale(heap, k)

    def _drop_stale(self, heap, k) -> None:
        while heap and not self.flags[k][heap[0][1]]:
            heapq.heappop(heap)

    def __contains__(self, task: Task) -> bool:
        return bool(self.flags[int(task.kind)][task.mb])

    def __iter__(self):
        for k in range(3):
            heap = self.heaps[k]
            self._drop_stale(heap, k)
            if heap:
                yield self.tasks[k][heap[0][1]]


def simulate(cfg: SimConfig) -> SimResult:
    S, M, split = cfg.stages, cfg.microbatches, cfg.split_backward
    var, seed, it = cfg.variability, cfg.seed, cfg.iteration
    s_idx = np.arange(S)[:, None]
    m_idx = np.arange(M)[None, :]
    dur = np.zeros((S, M, 3))
    dur[:, :, 0] = var.duration(seed, it, s_idx, m_idx, Kind.F) * np.ones((S, M))
    dur[:, :, 1] = var.duration(seed, it, s_idx, m_idx, Kind.B, split) * np.ones((S, M))
    if split:
        dur[:, :, 2] = var.duration(seed, it, s_idx, m_idx, Kind.W) * np.ones((S, M))
    lat_f = var.latency(seed, it, s_idx, m_idx, Kind.F) * np.ones((S, M))
    lat_b = var.latency(seed, it, s_idx, m_idx, Kind.B) * np.ones((S, M))
    sizes = (var.length(seed, it, np.arange(M)) * cfg.mb_bytes).astype(np.int64).tolist()
    D, LF, LB = dur.tolist(), lat_f.tolist(), lat_b.tolist()

    tasks = [[Task(Kind(k), m) for m in range(M)] for k in range(3)]
    orders = [cfg.hint.order(S, s, M, split) for s in range(S)]
    ranks = [cfg.hint.rank(S, s, M, split) for s in range(S)]
    rank_lists = [[[0] * M for _ in range(3)] for _ in range(S)]
    for s in range(S):
        for t, r in ranks[s].items():
            rank_lists[s][int(t.kind)][t.mb] = r
    limits = []
    for s in range(S):
        count = cfg.budget.microbatches(S, s)
        limits.append(Limit(count=count, bytes=cfg.budget.bytes))
    size_of = sizes.__getitem__ if cfg.budget.bytes is not None else None

    executor = cfg.executor
    ready = [_Ready(M, tasks) for _ in range(S)]
    state = [StageState() for _ in range(S)]
    f_done = [bytearray(M) for _ in range(S)]
    grad_in = [bytearray(M) for _ in range(S)]
    busy = [False] * S
    busy_time = [0.0] * S
    remaining = S * M * (3 if split else 2)
    timeline: list[tuple[int, Task, float, float]] = []
    decisions = 0
    events: list[tuple[float, int, int, int, int, int]] = []  # (time, seq, what, stage, kind, mb)
    DONE, ARRIVE = 0, 1
    seq = 0

    for m in range(M):
        ready[0].add(0, m, rank_lists[0][0][m])

    def dispatch(s: int, now: float) -> None:
        nonlocal seq, decisions
        st = state[s]
        task = choose(executor, ready[s], ranks[s], orders[s], st, limits[s], size_of)
        decisions += 1
        if task is None:
            return
        ready[s].remove(task)
        st.next_index += 1
        k = int(task.kind)
        if k == 0:
            st.admit(sizes[task.mb])
        end = now + D[s][task.mb][k]
        busy[s] = True
        busy_time[s] += end - now
        if cfg.record:
            timeline.append((s, task, now, end))
        seq += 1
        heapq.heappush(events, (end, seq, DONE, s, k, task.mb))

    for s in range(S):
        dispatch(s, 0.0)
    now = 0.0
    touched: set[int] = set()
    last = 0.0
    while events:
        now, _, what, s, k, m = heapq.heappop(events)
        if what == DONE:
            busy[s] = False
            remaining -= 1
            last = now
            if k == 0:
                f_done[s][m] = 1
                if s + 1 < S:
                    seq += 1
                    heapq.heappush(events, (now + LF[s][m], seq, ARRIVE, s + 1, 0, m))
                else:
                    ready[s].add(1, m, rank_lists[s][1][m])
            elif k == 1:
                if s > 0:
                    seq += 1
                    heapq.heappush(events, (now + LB[s][m], seq, ARRIVE, s - 1, 1, m))
                if split:
                    ready[s].add(2, m, rank_lists[s][2][m])
                else:
                    state[s].release(sizes[m])
            else:
                state[s].release(sizes[m])
        elif k == 0:
            ready[s].add(0, m, rank_lists[s][0][m])
        else:
            grad_in[s][m] = 1
            if f_done[s][m]:
                ready[s].add(1, m, rank_lists[s][1][m])
            else:  # cannot happen: the gradient of m follows F(s, m)
                raise AssertionError(f"gradient for microbatch {m} reached stage {s} before its F")
        touched.add(s)
        if not events or events[0][0] > now:
            for t in sorted(touched):
                if not busy[t]:
                    dispatch(t, now)
            touched.clear()

    if remaining:
        waits = []
        for s in range(S):
            nxt = orders[s][state[s].next_index] if executor is Executor.FIXED and state[s].next_index < len(orders[s]) else None
            waits.append(f"stage {s} waits for {nxt}" if nxt else f"stage {s} in-flight {state[s].inflight}")
        raise SimDeadlock(f"{executor} executor with hint {cfg.hint.name} stalled with {remaining} tasks left: "
                          + "; ".join(waits))
    return SimResult(
        config=cfg,
        makespan=last,
        busy=busy_time,
        peak_inflight=[st.peak_inflight for st in state],
        lower_bound=lower_bound(dur, lat_f, lat_b, split),
        decisions=decisions,
        timeline=timeline,
    )
