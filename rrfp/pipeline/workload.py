"""The contract between rrfp and a model: what ``rrfp train`` needs to train it.

A model module (``rrfp/models/gpt.py``) exposes ``workload = Workload(...)``; the
app finds it by name (``[run] model = "gpt"``), so adding a model needs no
edit to rrfp. Splitting stays model-agnostic: ``build_stage`` returns this
stage's part of the model as an ``nn.Module``, whatever the model is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rrfp.pipeline.user_code import calling, counted, function_name

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of one microbatch


def map_tensors(fn: Callable[[torch.Tensor], Any], value):
    """``fn`` on every tensor of a microbatch's inputs or a stage's outputs: a tensor, or (nested)
    tuples, named tuples (``VLMInputs``) and lists of them, rebuilt as they came; anything else as
    it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [map_tensors(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _no_check(model_cfg: Any, data_cfg: Any, num_stages: int, tp: int) -> None:
    return None


def token_features(batch: Batch) -> dict:
    """What a microbatch of token sequences costs: its targets' tokens and the attention
    term (rows x length squared). The cost model (rrfp.core.cost) turns these into time."""
    targets = batch[1]
    rows, length = (
        (targets.shape[0], targets.shape[-1]) if targets.dim() > 1 else (1, targets.numel())
    )
    return {"tokens": float(targets.numel()), "attn": float(rows * length * length), "patches": 0.0}


@dataclass(frozen=True)
class Workload:
    name: str
    model_config: type  # dataclass for the [model] section; validates itself
    data_config: type  # dataclass for the [data] section; validates itself
    # (model_cfg, stage, num_stages, tp_group) -> this stage's module, from the current torch seed
    build_stage: Callable[[Any, int, int, Any], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # (data_cfg, step, n_microbatches) -> that step's microbatches, the same on every rank
    batches: Callable[[Any, int, int], Sequence[Batch]]
    # (model_cfg, data_cfg, num_stages, tp): ValueError when the layout cannot fit the model,
    # called before any process group exists
    check: Callable[[Any, Any, int, int], None] = _no_check
    # microbatch -> {"tokens", "attn", "patches"}: what its tasks cost, for data-driven durations
    features: Callable[[Batch], dict] = token_features
    # (data_cfg, index, n_microbatches) -> held-out microbatches for evaluation ([eval]); None:
    # ``batches`` at step indices no run reaches (rrfp/app/train/evaluation.py)
    eval_batches: Callable[[Any, int, int], Sequence[Batch]] | None = None
    # (model_cfg, stage, num_stages) -> the ties that stage holds, {tie name: qualified parameter
    # name}: parameters shared between stages (a tied embedding and lm head), kept equal by rrfp
    tied: Callable[[Any, int, int], dict[str, str]] | None = None
    blocks: Callable[[nn.Module], list[nn.Module]] | None = (
        None  # stage module -> its transformer blocks, for activation checkpointing
    )
    # data_cfg -> what the data source found (documents, tokens, files, or "synthetic: ..."), one
    # phrase for ``rrfp train``'s start-up summary; None: the summary says only its batches' sizes
    describe_data: Callable[[Any], str] | None = None

    def build_stages(
        self,
        model_cfg: Any,
        stages: Sequence[int],
        num_stages: int,
        seed: int,
        tp_group: Any = None,
    ) -> list[nn.Module]:
        """One module per stage in ``stages`` (a rank's virtual stages), each built from ``seed`` as
        ``build_stage`` builds one: the full model from the seed, cut down to that stage, so that
        the pieces on every rank are pieces of one model."""
        modules = []
        for stage in stages:
            torch.manual_seed(seed)
            with calling(f"build_stage ({function_name(self.build_stage)}) for stage {stage}"):
                modules.append(self.build_stage(model_cfg, stage, num_stages, tp_group))
        return modules

    def microbatches(self, data_cfg: Any, step: int, n: int) -> Sequence[Batch]:
        """``batches(data_cfg, step, n)``, checked to be ``n`` microbatches: an error it raises,
        or another count, is the workload's (rrfp/pipeline/user_code.py)."""
        where = f"batches ({function_name(self.batches)}) for step {step + 1}"
        return counted(self.batches, where, data_cfg, step, n)
