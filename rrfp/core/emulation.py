"""Emulated device time of a task, in average forwards: the one function the
runtime's lane, the simulator's replay and the benchmark's torch anchors all
use, so every executor compared on an iteration spends the same time per task.

With a cost model and the microbatches' features, a task lasts what the cost
model predicts for its data times the preset's noise; without, the preset's
duration alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rrfp.core.cost import CostModel
from rrfp.core.variability import Variability


def task_units(var: Variability, seed: int, iteration: int, stage: int, mb: int, kind: int, split: bool,
               cost: CostModel | None = None, features: Sequence[dict] | None = None) -> float:
    """Units of task ``kind`` of microbatch ``mb`` on ``stage``. Unsplit B is B + W."""
    if cost is not None and features is not None:
        return cost.units(stage, int(kind), features[mb], split) * var.noise(seed, iteration, stage, mb, kind)
    return var.duration(seed, iteration, stage, mb, kind, split)


def iteration_units(var: Variability, seed: int, iteration: int, stages: int, microbatches: int, split: bool,
                    cost: CostModel | None = None, features: Sequence[dict] | None = None) -> np.ndarray:
    """[S, M, 3] units of every task of an iteration (W is 0 when the backward is not split)."""
    dur = np.zeros((stages, microbatches, 3))
    for s in range(stages):
        for m in range(microbatches):
            for k in range(3 if split else 2):
                dur[s, m, k] = task_units(var, seed, iteration, s, m, k, split, cost, features)
    return dur
