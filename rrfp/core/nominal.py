"""Nominal orders: what ready dispatch does with a class priority when every
task takes its average time and messages are free.

A class priority (BF, BFW) ranks B0 above F0, so it is no executable order;
its nominal order is one, for fixed dispatch and for ZB-H1. It is computed by
driving one ``RankTracker`` per rank in lock-step rounds, so it follows the
same readiness rules and policy as the runtime and the simulator.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

from rrfp.core.budget import Budget
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch, chunked_priority
from rrfp.core.rank_tracker import RankSpec, RankTracker
from rrfp.core.tasks import Task


@lru_cache(maxsize=16)
def nominal_orders(priority: Callable[[int, int, int, bool], Sequence[Task]], S: int, M: int, split: bool,
                   multiple: float) -> tuple[tuple[Task, ...], ...]:
    """Per-stage orders under ``priority`` (a function giving stage s's tasks,
    best first) when F = B = W = 1, messages are free and the budget is
    ``multiple`` x 1F1B's: the rank orders of one stage per rank."""
    return tuple(tuple(t for _, t in order)
                 for order in nominal_rank_orders(priority, VirtualLayout(S), M, split, multiple))


@lru_cache(maxsize=16)
def nominal_rank_orders(priority: Callable[[int, int, int, bool], Sequence[Task]], layout: VirtualLayout, M: int,
                        split: bool, multiple: float) -> tuple[tuple[tuple[int, Task], ...], ...]:
    """Per-rank orders over (stage, task) pairs under the class ``priority`` generalised to the
    rank's stages (``rrfp.core.policy.chunked_priority``), every chunk's task taking the same time,
    messages free, the budget ``multiple`` x 1F1B's over the rank (``Budget.rank_limit``)."""
    budget, S = Budget(multiple=multiple), layout.num_stages
    trackers = []
    for r in range(layout.ranks):
        per_stage = {s: {t: i for i, t in enumerate(priority(S, s, M, split))} for s in layout.stages_of(r)}
        trackers.append(RankTracker(RankSpec(layout, r, M, split, Dispatch.READY, chunked_priority(per_stage), (),
                                             budget.rank_limit(layout, r))))
    out: list[list[tuple[int, Task]]] = [[] for _ in trackers]
    while not all(tr.done for tr in trackers):
        started = []
        for r, tr in enumerate(trackers):
            item = tr.next()
            if item is not None:
                tr.start(*item)
                out[r].append((item.stage, item.task))
                started.append((r, item))
        if not started:
            raise AssertionError("nominal rank order stalled: "
                                 + "; ".join(f"rank {r} {tr.blocked()}" for r, tr in enumerate(trackers)))
        for r, item in started:
            dest = trackers[r].finish(*item)
            if dest is not None:
                trackers[layout.rank_of(dest)].arrive(dest, item.kind, item.mb)
    return tuple(tuple(o) for o in out)
