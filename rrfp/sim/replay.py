"""Replay a run's real microbatches in the simulator.

A run with ``emulation.cost`` and ``output.sizes`` keeps every step's microbatch
features; the same cost model and the same noise (seed, step, stage,
microbatch, kind) give the durations the run's lane emulated, so the
simulated and the measured iteration describe the same work. A planned run
is replayed with each step's plan, made as the run made it: from the
predicted durations of the step's features, not the realized ones. A run
with virtual stages records ``virtual`` and ``placement`` beside ``pp`` (the
ranks); its cost model then has one entry per global stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.sim.engine import SimConfig, simulate
from rrfp.sim.planned_hint import plan_iteration


def replay_durations(
    cost: CostModel,
    var: Variability,
    features: list[dict[str, Any]],
    seed: int,
    step: int,
    split: bool,
    layout: VirtualLayout | None = None,
) -> np.ndarray:
    """[S*V, M, 3] durations in emulated units, as the runtime's lane held them (``layout`` None:
    one stage per rank)."""
    return TaskTimes(var, seed, split, cost, layout).realized(
        step, cost.num_stages, len(features), features
    )


def replay(doc: dict[str, Any], cost: CostModel) -> list[tuple[int, float, float]]:
    """(step, simulated ms, measured ms) for every step of a sizes file."""
    var = Variability.preset(doc["preset"])
    hint, dispatch, budget = (
        resolve(doc["hint"]),
        Dispatch.parse(doc["dispatch"]),
        Budget.parse(doc["budget"]),
    )
    layout = VirtualLayout(
        doc["pp"], int(doc.get("virtual", 1)), doc.get("placement", "interleaved")
    )
    if cost.num_stages != layout.num_stages:
        raise ValueError(
            f"the cost model has {cost.num_stages} stage(s) but the run had {layout.num_stages} "
            f"({layout.ranks} rank(s) x {layout.virtual})"
        )
    out = []
    for step, (feats, wall) in enumerate(zip(doc["features"], doc["step_wall_s"])):
        dur = replay_durations(cost, var, feats, doc["seed"], step, doc["split"], layout)
        followed = hint
        if hint.planned:  # this step's plan, from what the run knew before the step
            times = TaskTimes(var, doc["seed"], doc["split"], cost, layout)
            followed, _ = plan_iteration(
                times, step, doc["pp"], len(feats), budget, dispatch, feats
            )
        cfg = SimConfig(
            doc["pp"],
            len(feats),
            followed,
            dispatch,
            budget,
            var,
            seed=doc["seed"],
            iteration=step,
            split=doc["split"],
            durations=dur.tolist(),
            virtual=layout.virtual,
            placement=layout.placement,
        )
        out.append((step, simulate(cfg).makespan * doc["unit_ms"], wall * 1e3))
    return out
