"""rrfp: a readiness-driven runtime for pipeline-parallel training.

This module is the public surface, the names a driver needs to embed a
pipeline: ``PipelineRuntime`` and its ``StageExecutor`` (``run_iteration``
returns an ``IterationResult``), ``stage_main(cfg)`` under torchrun, the model
contract ``Workload``, the split-aware and tensor-parallel layers, and
``simulate`` for what-if questions without a cluster, and ``ScheduleReady``, a
drop-in for torch.distributed.pipelining's ``Schedule1F1B``. ``rrfp/models/``,
``examples/``, ``benchmarks/`` and ``scripts/`` use nothing else
(tests/test_layers.py); tests/test_exports.py pins the list. The layers are
folders: ``core`` (pure), ``observe``, ``sim``, ``loop``, ``comm``, ``nn``,
``pipeline`` and ``app``; docs/design.md draws the map.

Every name loads on first use, so ``import rrfp`` loads no torch, and the
simulator and the pure core answer without it.
"""

import importlib
from typing import TYPE_CHECKING

if (
    TYPE_CHECKING
):  # what static tools and IDEs see; at run time each name loads on first use (__getattr__)
    from rrfp.app.config import TrainConfig
    from rrfp.app.train import StepReport, TrainSummary, stage_main
    from rrfp.core.cost import CostModel
    from rrfp.core.errors import PeerFailure, PipelineError
    from rrfp.core.policy import Dispatch, choose
    from rrfp.core.tracker import StageTracker
    from rrfp.core.variability import Variability
    from rrfp.hf import HFStage, build_hf_model, build_hf_stage, hf_config, hf_layer_ranges, hf_ties
    from rrfp.loop import run
    from rrfp.nn.split_linear import SplitLinear
    from rrfp.nn.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        group_size_rank,
        shard_from_full,
    )
    from rrfp.pipeline.calibration import calibrate
    from rrfp.pipeline.executor import IterationResult, StageExecutor
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.worker import SplitSummary, StageWorker
    from rrfp.pipeline.workload import Workload, token_features
    from rrfp.pipelining import ScheduleReady
    from rrfp.sim import SimConfig, SimResult, simulate
    from rrfp.sim.planned_hint import planned_config

# public name -> the module that defines it
_HOMES = {
    # running a pipeline: the runtime, one stage's executor and what it returns, its settings
    "PipelineRuntime": "rrfp.pipeline.runtime",
    "StageExecutor": "rrfp.pipeline.executor",
    "IterationResult": "rrfp.pipeline.executor",
    "StageWorker": "rrfp.pipeline.worker",
    "SplitSummary": "rrfp.pipeline.worker",
    "Dispatch": "rrfp.core.policy",
    "Variability": "rrfp.core.variability",
    "CostModel": "rrfp.core.cost",
    "run": "rrfp.loop",
    "PipelineError": "rrfp.core.errors",
    "PeerFailure": "rrfp.core.errors",
    # training a workload, as `rrfp train` does
    "stage_main": "rrfp.app.train",
    "TrainConfig": "rrfp.app.config",
    "TrainSummary": "rrfp.app.train",
    "StepReport": "rrfp.app.train",
    "Workload": "rrfp.pipeline.workload",
    "token_features": "rrfp.pipeline.workload",
    # the cost model of any stage modules, without a Workload
    "calibrate": "rrfp.pipeline.calibration",
    # layers that defer weight gradients to W, and tensor parallelism
    "SplitLinear": "rrfp.nn.split_linear",
    "ColumnParallelLinear": "rrfp.nn.tensor_parallel",
    "RowParallelLinear": "rrfp.nn.tensor_parallel",
    "group_size_rank": "rrfp.nn.tensor_parallel",
    "shard_from_full": "rrfp.nn.tensor_parallel",
    # the simulator and the policy it shares with the runtime
    "simulate": "rrfp.sim",
    "SimConfig": "rrfp.sim",
    "SimResult": "rrfp.sim",
    # hint = "plan" made for a simulated iteration (simulate alone runs BFW)
    "planned_config": "rrfp.sim.planned_hint",
    "choose": "rrfp.core.policy",
    "StageTracker": "rrfp.core.tracker",
    # a drop-in for torch.distributed.pipelining's schedules
    "ScheduleReady": "rrfp.pipelining",
    # HuggingFace causal LMs split into stages (the rrfp[hf] extra: transformers loads on first
    # build)
    "HFStage": "rrfp.hf",
    "build_hf_stage": "rrfp.hf",
    "build_hf_model": "rrfp.hf",
    "hf_layer_ranges": "rrfp.hf",
    "hf_config": "rrfp.hf",
    "hf_ties": "rrfp.hf",
}

__all__ = [
    "ColumnParallelLinear",
    "CostModel",
    "Dispatch",
    "IterationResult",
    "PeerFailure",
    "PipelineError",
    "PipelineRuntime",
    "RowParallelLinear",
    "ScheduleReady",
    "SimConfig",
    "SimResult",
    "SplitLinear",
    "SplitSummary",
    "StageExecutor",
    "StageTracker",
    "StageWorker",
    "StepReport",
    "TrainConfig",
    "TrainSummary",
    "Variability",
    "Workload",
    "choose",
    "group_size_rank",
    "planned_config",
    "run",
    "shard_from_full",
    "simulate",
    "stage_main",
    "token_features",
    "calibrate",
    "HFStage",
    "build_hf_model",
    "build_hf_stage",
    "hf_config",
    "hf_layer_ranges",
    "hf_ties",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rrfp' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
