"""Run RankTrackers through time: the one event rule of the simulator and the nominal orders.

Tasks end after their duration and messages arrive after their latency (the V turn, from one
stage of a rank to another of the same rank, is no message and arrives at once). All events at
one time are applied before time moves on; then every idle rank they touched decides, in rank
order, so the order in which equal times were pushed cannot change a decision. Times are floats,
so two events that would coincide exactly can land an ulp apart and be decided in two rounds;
every caller sees the same arithmetic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from rrfp.core.rank_tracker import RankTracker, StageTask
from rrfp.core.tasks import Task

Duration = Callable[
    [int, Task], float
]  # (stage, task) -> how long it runs, or the latency of the message it sends
Decided = Callable[
    [int, "StageTask | None", float, float], None
]  # (rank, what it started or None, now, end)


def drive(
    trackers: Sequence[RankTracker],
    rank_of: Sequence[int],
    duration: Duration,
    latency: Duration,
    decided: Decided | None = None,
) -> float:
    """Start every rank at time 0 and run until no event is left; the time the last task ended.
    ``decided`` hears every decision, also those that started nothing. Whether every task ran
    (``RankTracker.done``) is the caller's to check: a stall just runs out of events."""
    # (time, sequence, rank, stage, task, arriving): a task done, or its message arriving at stage
    events: list[tuple[float, int, int, int, Task, bool]] = []
    seq = itertools.count()

    def start(r: int, now: float) -> None:
        item = trackers[r].next()
        if item is None:
            if decided is not None:
                decided(r, None, now, now)
            return
        trackers[r].start(item.stage, item.task)
        end = now + duration(item.stage, item.task)
        if decided is not None:
            decided(r, item, now, end)
        heapq.heappush(events, (end, next(seq), r, item.stage, item.task, False))

    for r in range(len(trackers)):
        start(r, 0.0)
    touched: set[int] = set()
    last = 0.0
    while events:
        now, _, r, stage, task, arriving = heapq.heappop(events)
        if arriving:
            trackers[r].arrive(stage, task.kind, task.mb)
        else:
            last = now
            dest = trackers[r].finish(stage, task)
            if dest is not None:
                to = rank_of[dest]
                if to == r:  # the V turn: no message
                    trackers[r].arrive(dest, task.kind, task.mb)
                else:
                    heapq.heappush(
                        events, (now + latency(stage, task), next(seq), to, dest, task, True)
                    )
        touched.add(r)
        if not events or events[0][0] > now:  # time moves on: idle ranks decide
            for t in sorted(touched):
                if trackers[t].running is None:
                    start(t, now)
            touched.clear()
    return last
