"""The planned hint: score entry orders by simulating the predicted durations,
and turn the best into a hint.

The simulator and the runtime both plan through ``make_plan``. What the
planner knows is the predictable part of each task's time
(``rrfp.core.durations``); the run it is judged by has jitter, stragglers and
link jitter on top. Fixed dispatch with a plan replays what ready dispatch
would do on the predicted durations (plan, then replay a fixed order, as
planners that do not adapt at run time do): the ablation beside ready plan.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from rrfp.core.budget import Budget
from rrfp.core.durations import known
from rrfp.core.hints import Hint
from rrfp.core.planner import Plan, entry_order_hint, plan
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.sim.engine import SimConfig, _durations, simulate


def make_plan(predicted: np.ndarray, budget: Budget, variability: Variability, split: bool,
              dispatch: Dispatch = Dispatch.READY) -> tuple[Hint, Plan]:
    """The hint for one iteration from ``predicted[s, m, kind]``; ``variability``
    gives the link latency the planner assumes (its jitter is hidden)."""
    S, M, _ = predicted.shape
    base = SimConfig(S, M, "bfw", Dispatch.READY, budget, known(variability), split=split, durations=predicted)

    def hint(order) -> Hint:
        return Hint("plan", entry_order_hint(order), is_class=True)

    made = plan(predicted, lambda order: simulate(replace(base, hint=hint(order))).makespan)
    if dispatch is not Dispatch.FIXED:
        return hint(made.order), made
    run = simulate(replace(base, hint=hint(made.order), record=True))
    orders = tuple(tuple(t for st, t, *_ in sorted(run.timeline, key=lambda e: e[2]) if st == s) for s in range(S))
    return replace(hint(made.order), fixed_orders=orders), made


def planned_config(cfg: SimConfig) -> tuple[SimConfig, Plan]:
    """``cfg`` with its hint replaced by this seed's plan, made from the preset's
    predictable part (per-microbatch factors, a slow stage)."""
    predicted = _durations(replace(cfg, variability=known(cfg.variability), record=False))[0]
    made_hint, made = make_plan(predicted, cfg.budget, cfg.variability, cfg.split_backward, cfg.dispatch)
    return replace(cfg, hint=made_hint), made
