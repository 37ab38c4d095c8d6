"""Deprecated path of ``rrfp.sim.planned_hint`` (the planned hint made from predicted times),
kept importable for one release: it re-exports that module's names and warns once."""

import warnings

from rrfp.sim.planned_hint import make_plan, plan_iteration, planned_config

__all__ = ["make_plan", "plan_iteration", "planned_config"]

warnings.warn(
    "rrfp.sim.planning is deprecated: import rrfp.sim.planned_hint (or rrfp.planned_config)",
    DeprecationWarning,
    stacklevel=2,
)
