"""rrfp for torchtitan users: torchtitan's model, its split into stages and its placement of them,
stepped by rrfp's ``ScheduleReady`` in place of torch's schedule.

The switch is one argument: ``--module rrfp.titan`` where a run says ``--module llama3``, with the
same ``--config`` name (torchtitan's ConfigManager imports ``rrfp.titan.config_registry`` and
calls the function of that name, rrfp/titan/config_registry.py). ``parallelism.rrfp_hint``,
``rrfp_budget`` and ``rrfp_dispatch`` pick rrfp's order, memory and dispatch;
``parallelism.pipeline_parallel_schedule`` still picks the placement, as in torchtitan.
docs/torchtitan.md says what runs where.
"""

from __future__ import annotations

try:
    import torchtitan  # noqa: F401
except ImportError as e:  # the extra is not installed: one line that says which
    raise ImportError(f"rrfp.titan needs torchtitan ({e}): pip install 'rrfp[titan]'") from None

from rrfp.titan.config import ReadyParallelism, ReadyTrainerConfig, with_ready_schedule
from rrfp.titan.pipelining import pipeline_ready

__all__ = ["ReadyParallelism", "ReadyTrainerConfig", "pipeline_ready", "with_ready_schedule"]
