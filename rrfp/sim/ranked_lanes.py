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
there. So every task starts at the instant ``RankedPipeline.run`` starts it, computed with
the same float additions. Virtual stages, zero-length tasks, other rankings, a step in which
no lane moves and a run past a bound on its steps are declined (None): the caller then steps
``RankedPipeline.run``, which stays the definition; ``tests/sim/test_ranked_lanes.py`` holds
the two to the same makespans.
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
    lane's M values in ranking order and a sentinel at M (its kind ran every task)."""
    S, M, _ = p.dur.shape
    C, B, W = len(rankings), S + 1, M + 1  # B: a ranking's block of rows; W: a row's width
    L = C * B + 1
    split = p.split
    inf = np.inf
    orders = np.array([r.order for r in rankings], dtype=np.int64).reshape(C, M)
    rows = np.arange(C)[:, None] * B + 1 + np.arange(S)[None, :]  # (c, s) -> its row
    lanes = rows.ravel()
    spare = L * W  # one cell past the rows: where the writes of lanes that send nothing go

    def table(per_stage: np.ndarray, pad: float) -> np.ndarray:
        """``per_stage[s, m]`` laid out flat: ranking c's block holds ``per_stage[:, order_c]``."""
        flat = np.full(spare + 1, pad)
        grid = flat[:spare].reshape(L, W)
        for c in range(C):
            grid[c * B + 1 : c * B + 1 + S, :M] = per_stage[:, orders[c]]
        return flat

    D = np.concatenate([table(np.ascontiguousarray(p.dur[:, :, k]), 0.0) for k in range(3)])
    b_off, w_off = spare + 1, 2 * (spare + 1)  # where B's and W's tables start in D
    # a head's neighbour runs it on the row before (F) or after (B): its duration is there
    f_prev, b_next = -W, W + b_off
    stage = np.full(L, -1)
    stage[lanes] = np.tile(np.arange(S), C)
    # arrival times: inf while unknown, -inf where nothing is awaited (stage 0's inputs, the last
    # stage's gradients), nan at the sentinel: never there, never awaited
    AF = np.full((L, W), inf)
    AF[stage == 0, :M] = -inf
    AB = np.full((L, W), inf)
    AB[stage == S - 1, :M] = -inf
    AF[:, M] = AB[:, M] = np.nan
    AF, AB = np.append(AF.ravel(), inf), np.append(AB.ravel(), inf)

    def per_lane(values: Sequence[float] | np.ndarray, at: np.ndarray, pad: float) -> np.ndarray:
        out = np.full(L, pad)
        out[lanes] = np.asarray(values, dtype=np.float64)[at]
        return out

    st = np.tile(np.arange(S), C)
    lat_f = np.array(p.lat_f + [0.0, 0.0])  # lat_f[s]: s -> s + 1
    lat_b = np.array([0.0] + p.lat_b + [0.0])  # lat_b[s + 1]: s -> s - 1
    to_next, to_prev = per_lane(lat_f, st, 0.0), per_lane(lat_b, st + 1, 0.0)
    from_prev, from_next = per_lane(lat_f, st - 1, 0.0), per_lane(lat_b, st + 2, 0.0)
    counts = [(M + 1) if lm.count is None else lm.count for lm in p.limits]
    lim = per_lane(counts, st, 0).astype(np.int64)  # a quiet row admits nothing
    byte_lim = [lm.bytes for lm in p.limits]
    bytes_on = any(b is not None for b in byte_lim)
    if bytes_on:
        blim = per_lane([inf if b is None else b for b in byte_lim], st, inf)
        SZ = table(np.broadcast_to(np.array(p.sizes, dtype=np.float64), (S, M)), 0.0)
        held_bytes = np.zeros(L)
    base = np.arange(L, dtype=np.int64) * W
    quiet = stage < 0
    # each lane's heads as indices into the flat tables: the next F, B and W to start
    iF, iB = base + M * quiet, base + M * quiet
    iW = base + M * (quiet | (not split))
    last_head = base + M
    held = np.zeros(L, dtype=np.int64)
    padded = np.full(L + 2, inf)
    clock, prev_clock, next_clock = padded[1:-1], padded[:-2], padded[2:]
    clock[~quiet] = 0.0
    last_end = np.zeros(L)
    done = iW if split else iB  # a lane's last kind of task
    # a real run takes about one step per task of a stage (1.5 at 128 x 1024); past this many,
    # give the run to the event loop rather than risk clocks that chase each other for ever
    for step in range(1, 64 * (3 * M + S)):
        aF, aB = AF[iF], AB[iB]
        # where a head's arrival is unknown (inf), the neighbour has not started the task that
        # sends it: it starts it no earlier than its clock, so the message arrives no earlier
        # than clock + duration + latency (the same additions, in the same order). Where it is
        # known, the neighbour's clock is past that task's end, so the bound is above the
        # arrival and the minimum is the arrival.
        admit = held < lim
        if bytes_on:
            admit &= (held_bytes + SZ[iF] <= blim) | (held == 0)
        f_time = np.where(admit, np.minimum(aF, prev_clock + D[iF + f_prev] + from_prev), inf)
        b_time = np.where(iB < iF, np.minimum(aB, next_clock + D[iB + b_next] + from_next), inf)
        may_b = b_time <= clock  # a B that is or may be there outranks everything
        may_f = f_time <= clock  # (nan where every F ran: never)
        pick_b = may_b & (aB <= clock)
        pick_f = (aF <= clock) & admit & ~may_b
        pick_w = (iW < iB) & ~(may_b | may_f)
        start = pick_b | pick_f | pick_w
        # a lane that may have a better head than it knows of (may_* without pick_*) waits for
        # its neighbour's clock to say; an idle one moves on to the next instant one can come
        end = clock + D[np.where(pick_f, iF, np.where(pick_b, iB + b_off, iW + w_off))]
        AF[np.where(pick_f, iF + W, spare)] = end + to_next
        AB[np.where(pick_b, iB - W, spare)] = end + to_prev
        released = pick_w if split else pick_b
        if bytes_on:
            held_bytes += np.where(pick_f, SZ[iF], 0.0) - np.where(
                released, SZ[iW] if split else SZ[iB], 0.0
            )
        held += pick_f
        held -= released
        iF += pick_f
        iB += pick_b
        iW += pick_w
        np.copyto(last_end, end, where=start)
        # waiting lanes have an arrival at or before their clock, idle ones only after it
        wake = np.maximum(clock, np.fmin(f_time, b_time))
        if step % 32 == 0 and not start.any():  # now and then: is every lane done, or stuck?
            if (done == last_head).all():
                return [float(x) for x in last_end[rows].max(axis=1)]
            if np.array_equal(wake, clock):
                return None  # nothing moves, so nothing ever will: the run stalls
        clock[:] = np.where(start, end, wake)
    return None
