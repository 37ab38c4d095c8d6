"""The simulator's fast path: ready dispatch of a hint that ranks each kind of task by
one microbatch order, the same on every stage (bf, bfw, plan), when every message on
a link takes the same time (no link jitter).

Why it is exact. Stage 0 has all its inputs at once, so its best ready forward is
always the first in rank order not yet run. Stage s receives its inputs in the order
s-1 ran them, and with one latency per link they arrive in that order: rank order
again. The last stage's B(m) is ready once F(m) ends, so in rank order; its gradients
reach s-1 in that order, and B(m) there needs the gradient and F(m), both of which
come in rank order. W(m) needs B(m). So on every stage the ready tasks of each kind
are the next ones of that kind in rank order, and choosing among them is choosing
among three heads: the best priority (``rrfp.core.policy.choose``), a forward only
if the budget admits it. Arrivals are counters and the heads are indices, where the
tracker keeps sets and heaps.

The argument holds per global stage, for any number V of stages per rank: a stage's inputs
come in the order its predecessor ran them, over a link of one latency or the V turn, which
is no message and arrives at once. A rank then chooses among the heads of its local stages
as ``RankTracker`` does: by ``merge_local_priorities`` (the stage rule's place, then the later
local stage first), the best non-F, else the best F if ``RankTracker._admits`` lets it in
(the lead over the next local stage, the reserve for later ones, bytes), else a better F of
a later local stage than every refused one. (Under one order a later local stage's F always
ranks first, since its microbatch came through the earlier one, so that last rule never
finds one; it is kept as ``choose`` has it.) The budget is the rank's, in local-stage
microbatches over all its stages, released at a local stage's last backward. With V = 1
each rank has one local stage and nothing is reserved: the stage budget.

``StageTracker`` (rrfp/core/tracker.py) and ``RankTracker`` (rrfp/core/rank_tracker.py)
stay the one definition of the rules; this restates them for heads, and
``tests/sim/test_sim_ranked.py`` holds the two to the same timeline, busy time, peaks and
decision counts. ``simulate(cfg, reference=True)`` always steps the trackers. Events
and instants are the tracker path's: everything that happens at one instant is
applied before any idle rank decides, and the touched ranks decide in rank order.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rrfp.core.budget import Limit
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind, Task


@dataclass(frozen=True)
class Ranking:
    """A priority as one microbatch order: ``priority[kind][i]`` is the priority of kind's task
    of microbatch ``order[i]``, increasing in ``i`` for every kind."""

    order: tuple[int, ...]
    priority: tuple[tuple[int, ...], ...]


def ranking_of(priority: Mapping[Task, int], n_microbatches: int, split: bool) -> Ranking | None:
    """``priority`` (one stage's) as a Ranking, or None when some kind ranks its microbatches in
    another order than the forwards do (then only the trackers can run it)."""
    M = n_microbatches
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    try:
        by_kind = [[priority[Task(k, m)] for m in range(M)] for k in kinds]
    except KeyError:
        return None
    order = tuple(sorted(range(M), key=by_kind[0].__getitem__))
    ranked = [tuple(p[m] for m in order) for p in by_kind] + ([] if split else [(0,) * M])
    if any(a >= b for p in ranked[: len(kinds)] for a, b in zip(p, p[1:])):
        return None
    return Ranking(order, tuple(ranked))


def bfw_ranking(order: Sequence[int], split: bool) -> Ranking:
    """The Ranking of ``entry_order_hint(order)`` (B, then F, then W, each in ``order``), made
    from the order itself: what ``ranking_of`` finds in its priority, without building it."""
    M = len(order)
    keys = range(M)
    f, b, w = tuple(k + M for k in keys), tuple(keys), tuple(k + 2 * M for k in keys)
    return Ranking(tuple(int(m) for m in order), (f, b, w if split else (0,) * M))


@dataclass
class RankedRun:
    makespan: float
    busy: list[float]  # per rank
    decisions: list[int]
    peaks: list[int]  # per rank, in local-stage microbatches
    timeline: list[tuple[int, Task, float, float]]  # (global stage, task, start, end), if recorded
    stage_busy: list[float]  # per global stage
    stage_peaks: list[int]


class RankedPipeline:
    """One iteration's durations, link latencies, microbatch sizes and budget, ready to run under
    many rankings (the planner scores several entry orders on the same durations)."""

    def __init__(
        self,
        dur: np.ndarray,
        lat_f: np.ndarray,
        lat_b: np.ndarray,
        limits: Sequence[Limit],
        sizes: Sequence[int],
        split: bool,
        layout: VirtualLayout | None = None,
    ) -> None:
        """``dur``, ``lat_f`` and ``lat_b`` over global stages; ``limits`` per rank
        (``Budget.rank_limit``); ``sizes`` a local stage's bytes per microbatch; ``layout`` None:
        one stage per rank."""
        self.dur, self.split = np.asarray(dur, dtype=np.float64), split
        self.lat_f = [float(x) for x in np.asarray(lat_f)[:, 0]]
        self.lat_b = [float(x) for x in np.asarray(lat_b)[:, 0]]
        self.limits, self.sizes = list(limits), list(sizes)
        N = self.dur.shape[0]
        lay = VirtualLayout(N) if layout is None else layout
        if lay.num_stages != N:
            raise ValueError(f"durations for {N} stages, but the layout has {lay.num_stages}")
        self.layout = lay  # what the layout says, once for all the rankings run here
        self._stages = [lay.stages_of(r) for r in range(lay.ranks)]
        self._rank_of = [lay.rank_of(g) for g in range(N)]
        self._local_next = [
            g + 1 < N and self._rank_of[g + 1] == self._rank_of[g] for g in range(N)
        ]  # the V turn after g: the rank's own next stage, no message
        self._leads = [lay.leads(r) for r in range(lay.ranks)]

    @staticmethod
    def fits(lat_f: np.ndarray, lat_b: np.ndarray) -> bool:
        """Every message on a link takes the same time, so arrivals keep the order of sends."""
        return all(
            bool((lat == lat[:, :1]).all()) for lat in (np.asarray(lat_f), np.asarray(lat_b))
        )

    def run(self, ranking: Ranking, record: bool = False) -> RankedRun | None:
        """The iteration under ``ranking``; None if it stalls (the trackers then say why)."""
        return _run(self, ranking, record)


def _run(p: RankedPipeline, ranking: Ranking, record: bool) -> RankedRun | None:
    """``RankTracker``'s rules on heads, for every V. State is kept per global stage (the heads
    and arrivals) and per rank (the running task and the budget); an event's code says what
    happened: g < N a task of stage g finished, N + g an input and 2N + g a gradient reached g."""
    lay, split = p.layout, p.split
    N, M, _ = p.dur.shape
    R, V = lay.ranks, lay.virtual
    stages, rank_of, leads, local_next = p._stages, p._rank_of, p._leads, p._local_next
    o = np.asarray(ranking.order, dtype=np.int64)
    DF, DB, DW = (p.dur[:, o, k].tolist() for k in range(3))
    LF, LB = p.lat_f, p.lat_b
    sizes = [p.sizes[m] for m in ranking.order]
    lim = [(M + 1) * V if lm.count is None else lm.count for lm in p.limits]  # above any reach
    blim = [lm.bytes for lm in p.limits]
    # a rank ranks its local stages' heads by ``merge_local_priorities``: the stage rule's place,
    # then the later local stage first (key p*V + V-1-c); each local stage gets its keys once
    keys = [[[q * V + V - 1 - c for q in pk] for pk in ranking.priority] for c in range(V)]
    local = [
        tuple((c, g, keys[c][0], keys[c][1], keys[c][2]) for c, g in enumerate(stages[r]))
        for r in range(R)
    ]
    # per global stage: the next task of each kind to start (an index into the order), arrivals
    nF, nB, nW = [0] * N, [0] * N, [0] * N
    arrF, arrB = [0] * N, [0] * N
    arrF[0] = M  # the first stage has all its inputs
    arrB[N - 1] = M  # the last stage needs no gradient
    fdone, bdone = [0] * N, [0] * N
    sheld, speaks, stage_busy = [0] * N, [0] * N, [0.0] * N
    # per rank: the budget in local-stage microbatches, forwards started per local stage, the task
    held, held_bytes, peaks = [0] * R, [0] * R, [0] * R
    forwards = [[0] * V for _ in range(R)]
    running = [-1] * R  # kind of the rank's running task, -1 when idle
    busy, decisions = [0.0] * R, [0] * R
    timeline: list[tuple[int, Task, float, float]] = []
    events: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    N2 = 2 * N

    def admits(r: int, c: int, i: int) -> bool:
        """``RankTracker._admits``: the lead over local stage c + 1, the reserve for later local
        stages, bytes (a local stage with nothing held at it or later always fits)."""
        reserve = V - 1 - c
        if reserve:
            fw = forwards[r]
            if fw[c] - fw[c + 1] >= leads[r][c]:
                return False
        if held[r] + reserve >= lim[r]:
            return False
        b = blim[r]
        return (
            b is None
            or held_bytes[r] + sizes[i] * (1 + reserve) <= b
            or not any(sheld[g] for g in stages[r][c:])
        )

    def decide(r: int, now: float) -> None:
        """Idle rank ``r`` picks among its heads as ``choose`` does, and starts what it picks: the
        best non-F, else the best F if ``admits`` it, else a better F of a later local stage than
        every refused one."""
        decisions[r] += 1
        k, best, nf = -1, 0, 0  # the pick's kind (-1: none yet) and key; F heads seen
        for c, g, kF, kB, kW in local[r]:
            j = nB[g]
            if j < fdone[g] and j < arrB[g] and (k < 0 or kB[j] < best):
                k, best, bg, bi = 1, kB[j], g, j
            if split:
                w = nW[g]
                if w < bdone[g] and (k < 0 or kW[w] < best):
                    k, best, bg, bi = 2, kW[w], g, w
            i = nF[g]
            if i < arrF[g]:
                if nf == 0:  # the first F head, kept apart: most decisions see one at most
                    fk, fc, fg, fi = kF[i], c, g, i
                elif nf == 1:
                    fs = [(fk, fc, fg, fi), (kF[i], c, g, i)]
                else:
                    fs.append((kF[i], c, g, i))
                nf += 1
        if nf == 1:
            if (k < 0 or fk < best) and admits(r, fc, fi):
                k, bg, bi, bc = 0, fg, fi, fc
        elif nf:
            fs.sort()
            refused = -1
            for key, c, g, i in fs:
                if k >= 0 and key >= best:
                    break
                if c > refused:
                    if admits(r, c, i):
                        k, bg, bi, bc = 0, g, i, c
                        break
                    refused = c
        if k < 0:
            return
        if k == 0:
            nF[bg] = bi + 1
            forwards[r][bc] += 1
            held[r] += 1
            held_bytes[r] += sizes[bi]
            sheld[bg] += 1
            if held[r] > peaks[r]:
                peaks[r] = held[r]
            if sheld[bg] > speaks[bg]:
                speaks[bg] = sheld[bg]
            end = now + DF[bg][bi]
        elif k == 1:
            nB[bg] = bi + 1
            end = now + DB[bg][bi]
        else:
            nW[bg] = bi + 1
            end = now + DW[bg][bi]
        running[r] = k
        busy[r] += end - now
        stage_busy[bg] += end - now
        if record:
            timeline.append((bg, Task(Kind(k), ranking.order[bi]), now, end))
        push(events, (end, bg))

    def settle(code: int, now: float) -> int:
        """Apply one event; returns the rank it concerns. A finished task sends its output on:
        over the V turn at once, over a link after its latency; its last backward releases the
        microbatch from the rank's budget."""
        if code < N:
            g = code
            r = rank_of[g]
            k, running[r] = running[r], -1
            if k == 0:
                fdone[g] += 1
                if local_next[g]:
                    arrF[g + 1] += 1
                elif g + 1 < N:
                    push(events, (now + LF[g], N + g + 1))
            elif k == 1:
                i = bdone[g]
                bdone[g] = i + 1
                if not split:
                    held[r] -= 1
                    held_bytes[r] -= sizes[i]
                    sheld[g] -= 1
                if g and local_next[g - 1]:
                    arrB[g - 1] += 1
                elif g:
                    push(events, (now + LB[g], N2 + g - 1))
            else:
                held[r] -= 1
                held_bytes[r] -= sizes[nW[g] - 1]
                sheld[g] -= 1
        elif code < N2:
            g = code - N
            arrF[g] += 1
            r = rank_of[g]
        else:
            g = code - N2
            arrB[g] += 1
            r = rank_of[g]
        return r

    now = 0.0
    deciding: Sequence[int] = range(R)
    while True:
        for r in deciding:
            if running[r] < 0:
                decide(r, now)
        if not events:
            break
        now, code = pop(events)
        deciding = []
        while True:  # every event of this instant, before any idle rank decides
            deciding.append(settle(code, now))
            if not events or events[0][0] > now:
                break
            now, code = pop(events)
        if len(deciding) > 1:
            deciding = sorted(set(deciding))
    # a complete run ends on a finish: every arrival is awaited by a task that ends later
    if not _complete(M, split, nF, nB, nW, running):
        return None
    return RankedRun(now, busy, decisions, peaks, timeline, stage_busy, speaks)


def _complete(
    M: int, split: bool, nF: list[int], nB: list[int], nW: list[int], running: list[int]
) -> bool:
    """Every stage ran all its tasks and no rank is still running one: else the run stalled."""
    return not (
        any(n < M for n in nF)
        or any(n < M for n in nB)
        or (split and any(n < M for n in nW))
        or any(r >= 0 for r in running)
    )
