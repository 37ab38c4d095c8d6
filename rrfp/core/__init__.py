"""The pure core: tasks, hints, the policy, budgets, variability, bounds and
the stage tracker. No torch, no I/O: the simulator and the runtime share it."""
from rrfp.core.budget import Budget, InFlight, Limit
from rrfp.core.hints import Hint, HintError, resolve
from rrfp.core.policy import Dispatch, choose
from rrfp.core.stats import StageStats
from rrfp.core.tasks import Kind, Task
from rrfp.core.tracker import StageSpec, StageTracker, TrackerError
from rrfp.core.variability import Variability

__all__ = ["Budget", "Dispatch", "Hint", "HintError", "InFlight", "Kind", "Limit", "StageSpec", "StageStats",
           "StageTracker", "Task", "TrackerError", "Variability", "choose", "resolve"]
