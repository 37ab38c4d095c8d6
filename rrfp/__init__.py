"""rrfp: a readiness-driven runtime for pipeline-parallel training.

This module is the public surface, the names a driver needs to embed a
pipeline: ``PipelineRuntime`` and its ``StageExecutor`` (``run_iteration``
returns an ``IterationResult``), ``stage_main(cfg)`` under torchrun, the model
contract ``Workload``, the split-aware, tensor-parallel and mixture-of-experts layers, and
``simulate`` for what-if questions without a cluster, and ``ScheduleReady``, a
drop-in for torch.distributed.pipelining's ``Schedule1F1B``. It is written
once, in ``_HOMES``: ``__all__`` is its keys, and the ``TYPE_CHECKING`` block
that static tools read is held to it by tests/house/test_exports.py. Every other name
stays in its subpackage (``rrfp.core.StageTracker``, ``rrfp.hf.HFStage``).
``rrfp.models``, ``examples/`` and ``benchmarks/`` use this surface and the
subpackages' own (tests/house/test_layers.py). The layers are folders: ``core``
(pure), ``observe``, ``sim``, ``loop``, ``comm``, ``nn``, ``pipeline`` and
``app``; docs/design.md draws the map.

Every name loads on first use, so ``import rrfp`` loads no torch, and the
simulator and the pure core answer without it.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # what static tools and IDEs see (``X as X``: an explicit re-export, as strict checkers want);
    # at run time each name loads on first use (__getattr__)
    from rrfp.app.config.train_config import TrainConfig as TrainConfig
    from rrfp.app.train.training import (
        StepReport as StepReport,
    )
    from rrfp.app.train.training import (
        TrainSummary as TrainSummary,
    )
    from rrfp.app.train.training import (
        stage_main as stage_main,
    )
    from rrfp.core.cost import CostModel as CostModel
    from rrfp.core.errors import (
        PeerFailure as PeerFailure,
    )
    from rrfp.core.errors import (
        PipelineError as PipelineError,
    )
    from rrfp.core.variability import Variability as Variability
    from rrfp.hf import (
        build_hf_model as build_hf_model,
    )
    from rrfp.hf import (
        build_hf_stage as build_hf_stage,
    )
    from rrfp.hf import (
        check_hf_checkpoint as check_hf_checkpoint,
    )
    from rrfp.hf import (
        hf_config as hf_config,
    )
    from rrfp.hf import (
        hf_ties as hf_ties,
    )
    from rrfp.loop import run as run
    from rrfp.nn.expert_parallel import ExpertParallel as ExpertParallel
    from rrfp.nn.expert_parallel import shard_experts as shard_experts
    from rrfp.nn.grouped_experts import GroupedExperts as GroupedExperts
    from rrfp.nn.moe_aux_loss import collect_aux_losses as collect_aux_losses
    from rrfp.nn.moe_layer import MoELayer as MoELayer
    from rrfp.nn.moe_router import TopKRouter as TopKRouter
    from rrfp.nn.split_linear import SplitLinear as SplitLinear
    from rrfp.nn.tensor_parallel import (
        ColumnParallelLinear as ColumnParallelLinear,
    )
    from rrfp.nn.tensor_parallel import (
        RowParallelLinear as RowParallelLinear,
    )
    from rrfp.nn.tensor_parallel import (
        group_size_rank as group_size_rank,
    )
    from rrfp.nn.tensor_parallel import (
        shard_from_full as shard_from_full,
    )
    from rrfp.pipeline.calibration import calibrate as calibrate
    from rrfp.pipeline.executor import (
        IterationResult as IterationResult,
    )
    from rrfp.pipeline.executor import (
        StageExecutor as StageExecutor,
    )
    from rrfp.pipeline.runtime import PipelineRuntime as PipelineRuntime
    from rrfp.pipeline.worker import StageWorker as StageWorker
    from rrfp.pipeline.workload import (
        Workload as Workload,
    )
    from rrfp.pipeline.workload import (
        token_features as token_features,
    )
    from rrfp.pipelining import ScheduleReady as ScheduleReady
    from rrfp.sim import (
        SimConfig as SimConfig,
    )
    from rrfp.sim import (
        SimResult as SimResult,
    )
    from rrfp.sim import (
        simulate as simulate,
    )
    from rrfp.sim.planned_hint import planned_config as planned_config

# the public surface, written once: public name -> the module that defines it
_HOMES = {
    # running a pipeline: the runtime, one stage's executor and what it returns, its settings
    "PipelineRuntime": "rrfp.pipeline.runtime",
    "StageExecutor": "rrfp.pipeline.executor",
    "IterationResult": "rrfp.pipeline.executor",
    "StageWorker": "rrfp.pipeline.worker",
    "Variability": "rrfp.core.variability",
    "CostModel": "rrfp.core.cost",
    "run": "rrfp.loop",
    "PipelineError": "rrfp.core.errors",
    "PeerFailure": "rrfp.core.errors",
    # training a workload, as `rrfp train` does
    "stage_main": "rrfp.app.train.training",
    "TrainConfig": "rrfp.app.config.train_config",
    "TrainSummary": "rrfp.app.train.training",
    "StepReport": "rrfp.app.train.training",
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
    # a mixture of experts: the layer, its router and grouped experts, and the auxiliary losses
    # gathered for a one-process reference (rrfp/nn/moe_layer.py)
    "MoELayer": "rrfp.nn.moe_layer",
    "TopKRouter": "rrfp.nn.moe_router",
    "GroupedExperts": "rrfp.nn.grouped_experts",
    "collect_aux_losses": "rrfp.nn.moe_aux_loss",
    # expert parallelism: the experts sharded over an EP group (rrfp/nn/expert_parallel.py)
    "ExpertParallel": "rrfp.nn.expert_parallel",
    "shard_experts": "rrfp.nn.expert_parallel",
    # the simulator
    "simulate": "rrfp.sim",
    "SimConfig": "rrfp.sim",
    "SimResult": "rrfp.sim",
    # hint = "plan" made for a simulated iteration (simulate alone runs BFW)
    "planned_config": "rrfp.sim.planned_hint",
    # a drop-in for torch.distributed.pipelining's schedules
    "ScheduleReady": "rrfp.pipelining",
    # HuggingFace causal LMs split into stages (the rrfp[hf] extra: transformers loads on first
    # build)
    "build_hf_stage": "rrfp.hf",
    "build_hf_model": "rrfp.hf",
    "check_hf_checkpoint": "rrfp.hf",
    "hf_config": "rrfp.hf",
    "hf_ties": "rrfp.hf",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rrfp' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
