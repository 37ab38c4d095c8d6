"""The pure core: tasks, hints, the policy, budgets, variability, bounds and
the stage and rank trackers. No torch, no I/O: the simulator and the runtime share it."""

from rrfp.core.budget import Budget, InFlight, Limit
from rrfp.core.hints import Hint, HintError, resolve
from rrfp.core.placement import Placement, VirtualLayout
from rrfp.core.policy import Dispatch, choose
from rrfp.core.rank_tracker import RankSpec, RankTracker, StageTask
from rrfp.core.stats import StageStats
from rrfp.core.tasks import Kind, Task
from rrfp.core.tracker import StageSpec, StageTracker, TrackerError
from rrfp.core.variability import Variability

__all__ = [
    "Budget",
    "Dispatch",
    "Hint",
    "HintError",
    "InFlight",
    "Kind",
    "Limit",
    "Placement",
    "RankSpec",
    "RankTracker",
    "StageSpec",
    "StageStats",
    "StageTask",
    "StageTracker",
    "Task",
    "TrackerError",
    "Variability",
    "VirtualLayout",
    "choose",
    "resolve",
]
