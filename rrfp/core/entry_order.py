"""A hint planned from known microbatch costs: the BFW priority with the
microbatches entering the pipeline in a planned order.

Before an iteration starts, every microbatch's content is known, so its
predicted cost is too (the cost model; in the simulator, the preset's
per-microbatch factors, with jitter and stragglers hidden). The planner scores
a few entry orders by simulating the predicted durations with the one state
machine and keeps the best; ready dispatch then absorbs what was not
predicted.

Why these orders: a pipeline fills at the pace of its first microbatches and
drains at the pace of its last ones, while the middle is hidden by the steady
state. So the candidates are "pyramids": short microbatches at both
ends, long ones in the middle, with the peak at a few places. The plain order
is always scored first, so the plan is never worse than BFW on what it knows.

Deterministic in its inputs (no clock, no randomness), so every rank and TP
peer computes the same plan without talking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rrfp.core.hints import bfw_ranked
from rrfp.core.tasks import Task

PEAKS = (0.5, 0.35, 0.65)  # where the pyramid's longest microbatches sit, as a fraction of M


def entry_order_hint(order: Sequence[int]) -> Callable[[int, int, int, bool], list[Task]]:
    """The BFW class priority, with microbatches ranked by their place in ``order``."""
    order = tuple(int(m) for m in order)

    def planned(S: int, s: int, M: int, split: bool) -> list[Task]:
        return bfw_ranked(order if len(order) == M else range(M), split)

    planned.__name__ = "plan"
    return planned


@dataclass(frozen=True)
class Plan:
    order: tuple[int, ...]  # microbatches in entry order
    predicted_makespan: float
    bfw_makespan: float  # the plain BFW order on the same predicted durations
    seconds: float  # planning time


def pyramid(cost: np.ndarray, peak: float) -> tuple[int, ...]:
    """Shortest microbatches at both ends, longest at ``peak`` (a fraction of the way in)."""
    left: list[int] = []
    right: list[int] = []
    for i, m in enumerate(np.argsort(cost, kind="stable")):
        (left if len(left) < peak * (i + 1) else right).append(int(m))
    return tuple(left + right[::-1])


def candidate_orders(cost: np.ndarray) -> list[tuple[int, ...]]:
    """Entry orders worth scoring, from each microbatch's predicted total cost: as
    given (plain BFW) first, then one pyramid per peak. Duplicates are dropped."""
    seen: dict[tuple[int, ...], None] = {tuple(range(len(cost))): None}
    for peak in PEAKS:
        seen.setdefault(pyramid(cost, peak), None)
    return list(seen)


def plan(
    predicted: np.ndarray, scores: Callable[[Sequence[tuple[int, ...]]], Sequence[float]]
) -> Plan:
    """``predicted[s, m, k]``: predicted durations; ``scores(orders)``: the makespan of each
    entry order on them (the simulator), all asked at once so that it can run them together.
    The first candidate is plain BFW, so the plan is never worse than BFW on the predicted
    durations."""
    t0 = time.perf_counter()
    cands = candidate_orders(predicted.sum(axis=(0, 2)))
    scored = [(s, i, o) for i, (s, o) in enumerate(zip(scores(cands), cands))]
    best, _, order = min(scored)
    return Plan(order, best, scored[0][0], time.perf_counter() - t0)
