"""rrfp: a readiness-driven runtime for pipeline-parallel training.

Entry points: ``stage_main(cfg)`` under torchrun, ``PipelineRuntime`` and
``StageExecutor.run_iteration`` for drivers that embed a pipeline iteration,
and ``rrfp.sim`` for what-if questions without a cluster.
"""
from .loop import run
from .policy import Executor, choose

__all__ = ["run", "choose", "Executor", "stage_main", "PipelineRuntime", "StageExecutor", "TrainConfig"]


def __getattr__(name):  # torch.distributed parts load on first use; the pure core stays light
    if name == "stage_main":
        from .train import stage_main

        return stage_main
    if name == "PipelineRuntime":
        from .runtime import PipelineRuntime

        return PipelineRuntime
    if name == "StageExecutor":
        from .executor import StageExecutor

        return StageExecutor
    if name == "TrainConfig":
        from .config import TrainConfig

        return TrainConfig
    raise AttributeError(name)
