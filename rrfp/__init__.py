"""rrfp: a readiness-driven runtime for pipeline-parallel training.

Entry points: ``stage_main(cfg)`` under torchrun, ``PipelineRuntime`` and
``StageExecutor.run_iteration`` for drivers that embed a pipeline iteration,
and ``rrfp.sim`` for what-if questions without a cluster. The layers are
folders: ``core`` (pure), ``observe``, ``sim``, ``loop``, ``comm``, ``nn``,
``pipeline`` and ``app``; docs/design.md draws the map.
"""
from rrfp.core.policy import Dispatch, choose
from rrfp.core.tracker import StageTracker
from rrfp.loop import run

__all__ = ["run", "choose", "Dispatch", "StageTracker", "stage_main", "PipelineRuntime", "StageExecutor",
           "TrainConfig"]


def __getattr__(name):  # torch.distributed parts load on first use; the pure core stays light
    if name == "stage_main":
        from rrfp.app.train import stage_main

        return stage_main
    if name == "PipelineRuntime":
        from rrfp.pipeline.runtime import PipelineRuntime

        return PipelineRuntime
    if name == "StageExecutor":
        from rrfp.pipeline.executor import StageExecutor

        return StageExecutor
    if name == "TrainConfig":
        from rrfp.app.config import TrainConfig

        return TrainConfig
    raise AttributeError(name)
