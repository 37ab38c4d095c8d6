"""The planned hint in the simulator: what the planner knows, and the plan it makes.

The planner sees each microbatch's predicted cost: the preset's per-microbatch
length and image factors and a persistently slow stage. Jitter, stragglers and
link jitter stay hidden from it; the simulation it is judged by has them all.
"""
from __future__ import annotations

from dataclasses import replace

from rrfp.core.hints import Hint
from rrfp.core.planner import Plan, entry_order_hint, plan
from rrfp.sim.engine import SimConfig, _durations, simulate


def planned_config(cfg: SimConfig) -> tuple[SimConfig, Plan]:
    """``cfg`` with its hint replaced by this iteration's plan."""
    known = replace(cfg.variability, jitter=0.0, straggler_p=0.0, comm_jitter=0.0)
    predicted_cfg = replace(cfg, variability=known, record=False)
    predicted = _durations(predicted_cfg)[0]

    def score(order) -> float:
        hint = Hint("plan", entry_order_hint(order), is_class=True)
        return simulate(replace(predicted_cfg, hint=hint)).makespan

    p = plan(predicted, score)
    return replace(cfg, hint=Hint("plan", entry_order_hint(p.order), is_class=True)), p
