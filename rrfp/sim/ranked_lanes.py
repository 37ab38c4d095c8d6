"""Many rankings' makespans at once: the fast path's rules (rrfp/sim/ranked.py) for one
stage per rank and the class rule BFW (the planner's rankings), stepped for every
(ranking, stage) pair together with numpy.

Why: the planner scores several entry orders of one iteration, and at 128 stages x 1024
microbatches stepping one event at a time in Python takes seconds per order. Here each
(ranking, stage) pair is a lane with a clock of its own, and one numpy step lets every
lane that can decide start its next task: the steps number about one stage's tasks.

Why it is exact. A stage decides when it is idle, on what has arrived by then: its own
tasks are done, and an input or gradient is there when its arrival time is at most the
lane's clock, as in the event loop, where every event of an instant is applied before an
idle rank decides (with no zero-length task, an instant has one round). Under BFW the
choice is the first kind whose head is ready: B, else F if the budget admits it, else W.
An arrival is known once the neighbour started the task that sends it (its end is then
fixed); until then the neighbour's clock bounds it from below: the neighbour runs heads in
ranking order, so it starts that very task no earlier than its clock, and the message
arrives no earlier than clock + duration + latency. A lane decides only when no head
whose arrival is unknown could be there and outrank its pick; an idle lane moves its clock
to the next instant something can arrive (a known arrival or a bound) and decides again
there; a lane with nothing left keeps its clock, its last task's end. So every task starts at
the instant ``RankedPipeline.run`` starts it, computed with the same float additions.

What a step costs is numpy's per call more than per lane: about 33 calls on a few hundred
lanes, so F and B share calls where they can, and once the last rankings in the list are done
(every 32 steps it looks) the others are stepped alone.

Virtual stages, zero-length tasks, other rankings, a step in which no lane moves and a run
past a bound on its steps are declined (None): the caller then steps ``RankedPipeline.run``,
which stays the definition; ``tests/sim/test_ranked_lanes.py`` holds the two to the same
makespans.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rrfp.sim.ranked import RankedPipeline, Ranking


def makespans(p: RankedPipeline, rankings: Sequence[Ranking]) -> list[float] | None:
    """The makespan of ``p`` under each ranking, or None where this path does not apply (V > 1, a
    zero-length task, a ranking that is not B, then F, then W, a run that stalls): then run each
    with ``p.run``."""
    kinds = 3 if p.split else 2
    if (
        p.layout.virtual != 1
        or not rankings
        or not all(_by_class(r, kinds) for r in rankings)
        or not (p.dur[:, :, :kinds] > 0).all()
    ):
        return None
    return _lanes(p, rankings)


def _by_class(ranking: Ranking, kinds: int) -> bool:
    """Every B outranks every F, and every F every W (the class rule BFW, the planner's): then a
    stage's choice is the first kind whose head is ready, whatever the microbatches."""
    f, b, w = ranking.priority
    return max(b) < min(f) and (kinds == 2 or max(f) < min(w))


def _lanes(p: RankedPipeline, rankings: Sequence[Ranking]) -> list[float] | None:
    """Lanes are rows: a quiet row (no tasks, clock inf) before each ranking's S stages and one
    after the last, so that every lane has neighbours to read and to send to. A row holds a
    lane's M values in ranking order and a sentinel at M (its kind ran every task).

    Why the layout: a step is a few dozen numpy calls on arrays of a few hundred lanes, so their
    count, not their length, sets the time. The F, B and W tables sit side by side in one index
    space (part k at k * N), the heads are one (3, lanes) array and the neighbours' clocks a
    (2, lanes) view, so that one call serves F and B (or all three kinds) at once."""
    S, M, _ = p.dur.shape
    C, B, W = len(rankings), S + 1, M + 1  # B: a ranking's block of rows; W: a row's width
    L = C * B + 1
    N = L * W  # one kind's table
    split = p.split
    inf, nan = np.inf, np.nan
    orders = np.array([r.order for r in rankings], dtype=np.int64).reshape(C, M)
    rows = np.arange(C)[:, None] * B + 1 + np.arange(S)[None, :]  # (c, s) -> its row
    lanes = rows.ravel()

    def table(per_stage: np.ndarray, pad: float) -> np.ndarray:
        """``per_stage[s, m]`` as an (L, W) grid: ranking c's rows hold ``per_stage[:, order_c]``"""
        grid = np.full((L, W), pad)
        for c in range(C):
            grid[c * B + 1 : c * B + 1 + S, :M] = per_stage[:, orders[c]]
        return grid

    DF, DB, DW = (table(np.ascontiguousarray(p.dur[:, :, k]), 0.0) for k in range(3))
    D = np.concatenate([DF.ravel(), DB.ravel(), DW.ravel()])  # a lane's own heads' durations
    # the neighbour's duration of a head's task: the row before runs its F, the row after its B
    DN = np.zeros(2 * N + 2)
    DN[W:N] = DF.ravel()[: N - W]
    DN[N : 2 * N - W] = DB.ravel()[W:]
    trash, never = 2 * N, 2 * N + 1  # where unsent messages go; what a masked head reads
    DN[never] = nan
    stage = np.full(L, -1)
    stage[lanes] = np.tile(np.arange(S), C)
    # arrival times (F's part, then B's): inf while unknown, -inf where nothing is awaited
    # (stage 0's inputs, the last stage's gradients), nan at the sentinel and in ``never``:
    # never there, never awaited
    AF = np.full((L, W), inf)
    AF[stage == 0, :M] = -inf
    AB = np.full((L, W), inf)
    AB[stage == S - 1, :M] = -inf
    AF[:, M] = AB[:, M] = nan
    A = np.concatenate([AF.ravel(), AB.ravel(), [inf, nan]])

    def per_lane(values: Sequence[float] | np.ndarray, at: np.ndarray, pad: float) -> np.ndarray:
        out = np.full(L, pad)
        out[lanes] = np.asarray(values, dtype=np.float64)[at]
        return out

    st = np.tile(np.arange(S), C)
    lat_f = np.array(p.lat_f + [0.0, 0.0])  # lat_f[s]: s -> s + 1
    lat_b = np.array([0.0] + p.lat_b + [0.0])  # lat_b[s + 1]: s -> s - 1
    to_nbr = np.stack([per_lane(lat_f, st, 0.0), per_lane(lat_b, st + 1, 0.0)])  # F on, B back
    from_nbr = np.stack([per_lane(lat_f, st - 1, 0.0), per_lane(lat_b, st + 2, 0.0)])
    counts = [(M + 1) if lm.count is None else lm.count for lm in p.limits]
    lim = per_lane(counts, st, 0).astype(np.int64)  # a quiet row admits nothing
    byte_lim = [lm.bytes for lm in p.limits]
    bytes_on = any(b is not None for b in byte_lim)
    blim = per_lane([inf if b is None else b for b in byte_lim], st, inf)
    if bytes_on:
        SZ = table(np.broadcast_to(np.array(p.sizes, dtype=np.float64), (S, M)), 0.0).ravel()
    base = np.arange(L, dtype=np.int64) * W
    quiet = stage < 0
    # each lane's heads (rows F, B, W) as indices into a table: the next task of each kind
    all_heads = np.stack([base + M * quiet, base + M * quiet, base + M * (quiet | (not split))])
    part = np.array([[0], [N], [2 * N]])  # a kind's table in D, A and DN
    sent = np.array([[W], [-W]])  # an F's input lands a row on, a B's gradient a row back
    all_held = np.zeros(L, dtype=np.int64)
    all_held_bytes = np.zeros(L)
    padded = np.full(L + 2, inf)  # the clocks, with a quiet neighbour at both ends
    padded[1:-1][~quiet] = 0.0
    # per lane: a head that may come (F admitted, B past its F), then the kind it starts (F, B, W)
    all_flags = np.empty((5, L), dtype=bool)
    makespan = [0.0] * C
    kept, width = C, 0  # the rankings still stepped: the first ``kept`` blocks of rows
    for step in range(1, 64 * (3 * M + S)):
        if width != kept * B + 1:  # once the last rankings are done, step only the others
            width = kept * B + 1
            heads, held, held_bytes = all_heads[:, :width], all_held[:width], all_held_bytes[:width]
            iF, iB, iW = heads
            done = iW if split else iB  # a lane's last kind of task
            lim_k, blim_k, last_head = lim[:width], blim[:width], base[:width] + M
            from_k, to_k = from_nbr[:, :width], to_nbr[:, :width]
            clock = padded[1 : width + 1]
            # the clocks of each lane's neighbours: the row before (F's sender), the row after
            nbr_clock = np.lib.stride_tricks.as_strided(
                padded, (2, width), (2 * padded.itemsize, padded.itemsize), writeable=False
            )
            awaited, picks = all_flags[:2, :width], all_flags[2:, :width]
            pick_f, pick_b, pick_w = picks
        at = heads + part
        np.less(held, lim_k, out=awaited[0])
        if bytes_on:
            awaited[0] &= (held_bytes + SZ[iF] <= blim_k) | (held == 0)
        np.less(iB, iF, out=awaited[1])
        looked = np.where(awaited, at[:2], never)
        # where a head's arrival is unknown (inf), the neighbour has not started the task that
        # sends it: it starts it no earlier than its clock, so the message arrives no earlier
        # than clock + duration + latency (the same additions, in the same order). Where it is
        # known, the neighbour's clock is past that task's end, so the bound is above the
        # arrival and the minimum is the arrival.
        arrival = A[looked]
        np.less_equal(arrival, clock, out=picks[:2])  # there now: F (if no B may be), B
        soonest = nbr_clock + DN[looked]
        soonest += from_k
        np.minimum(arrival, soonest, out=soonest)
        may = soonest <= clock  # F, B that are or may be there (nan where never: no)
        np.greater(pick_f, may[1], out=pick_f)  # a B that may be there outranks an F
        np.less(iW, iB, out=pick_w)
        np.greater(pick_w, may[0] | may[1], out=pick_w)
        start = pick_f | pick_b
        start |= pick_w
        # a lane that may have a better head than it knows of (may without a pick) waits for
        # its neighbour's clock to say; an idle one moves on to the next instant one can come
        end = clock + D[np.where(pick_f, at[0], np.where(pick_b, at[1], at[2]))]
        A[np.where(picks[:2], at[:2] + sent, trash)] = end + to_k
        if bytes_on:
            held_bytes += np.where(pick_f, SZ[iF], 0.0) - np.where(
                pick_w if split else pick_b, SZ[iW] if split else SZ[iB], 0.0
            )
        held += pick_f
        held -= pick_w if split else pick_b
        heads += picks
        # waiting lanes have an arrival at or before their clock, idle ones only after it; a
        # lane with nothing left to await keeps its clock: its last task's end
        wake = np.fmax(clock, np.fmin(soonest[0], soonest[1]))
        if step % 32:
            clock[:] = np.where(start, end, wake)
            continue
        # now and then: are the last rankings done (then drop them), or is every lane stuck?
        moved = start.any() or not np.array_equal(wake, clock)
        clock[:] = np.where(start, end, wake)
        while kept and (done[rows[kept - 1]] == last_head[rows[kept - 1]]).all():
            kept -= 1
            makespan[kept] = float(clock[rows[kept]].max())
        if not kept:
            return makespan
        if not moved:
            return None  # nothing moves, so nothing ever will: the run stalls
    return None
