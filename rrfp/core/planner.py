"""A hint planned from known microbatch costs: the BFW priority with the
microbatches entering the pipeline in a planned order.

Before an iteration starts, every microbatch's content is known, so its
predicted cost is too (the cost model; in the simulator, the preset's
per-microbatch factors, with jitter and stragglers hidden). The planner tries
a few entry orders, scores each by simulating the predicted durations with the
one state machine, and keeps the best; ready dispatch then absorbs what was
not predicted. Deterministic in its inputs, so every rank and TP peer computes
the same plan without talking.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rrfp.core.hints import bfw_ranked
from rrfp.core.tasks import Task


def entry_order_hint(order: Sequence[int]) -> Callable[[int, int, int, bool], list[Task]]:
    """The BFW class priority, with microbatches ranked by their place in ``order``."""
    order = tuple(order)

    def planned(S: int, s: int, M: int, split: bool) -> list[Task]:
        return bfw_ranked(order if len(order) == M else range(M), split)

    planned.__name__ = "plan"
    return planned


@dataclass(frozen=True)
class Plan:
    order: tuple[int, ...]  # microbatches in entry order
    predicted_makespan: float
    bfw_makespan: float  # the plain BFW order on the same predicted durations
    candidates: int
    seconds: float  # planning time


def candidate_orders(cost: np.ndarray) -> list[tuple[int, ...]]:
    """Entry orders worth scoring, from each microbatch's predicted total cost: as given
    (plain BFW), longest first, shortest first, and long and short alternating."""
    M = len(cost)
    by_cost = [int(m) for m in np.argsort(-cost, kind="stable")]
    alternating = [by_cost[(i // 2) if i % 2 == 0 else M - 1 - i // 2] for i in range(M)]
    seen: dict[tuple[int, ...], None] = {}
    for order in (tuple(range(M)), tuple(by_cost), tuple(reversed(by_cost)), tuple(alternating)):
        seen.setdefault(order, None)
    return list(seen)


def plan(predicted: np.ndarray, score: Callable[[Sequence[int]], float]) -> Plan:
    """``predicted[s, m, k]``: predicted durations; ``score(order)``: makespan of that
    entry order on them (the simulator). The first candidate is plain BFW, so the plan
    is never worse than BFW on the predicted durations."""
    t0 = time.perf_counter()
    cands = candidate_orders(predicted.sum(axis=(0, 2)))
    scored = [(score(o), i, o) for i, o in enumerate(cands)]
    best, _, order = min(scored)
    return Plan(order, best, scored[0][0], len(cands), time.perf_counter() - t0)
