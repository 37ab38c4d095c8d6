"""``pipeline_ready``: a torchtitan pipelining function (``ModelSpec.pipelining_fn``) that keeps
the model spec's own one (``pipeline_llm``: its split into stages, its placement of them on the pp
ranks, its per-stage parallelize function) and steps the stages with rrfp's ``ScheduleReady``
instead of the torch schedule it built.

torchtitan places a rank's stages from the schedule's name
(torchtitan/distributed/pipeline_parallel.py, ``_get_pp_rank_to_stage_indices_mapping``): one stage
per rank for the single-stage schedules, ``r, r + S`` for the looped ones, ``r, 2S - 1 - r`` (V) for
ScheduleZBVZeroBubble and ScheduleDualPipeV. ScheduleReady reads the placement off the stage
indices, so each of those runs as torchtitan placed it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.distributed.pipeline_parallel import pipeline_llm

from rrfp.core.budget import DEFAULT_BUDGET
from rrfp.core.hints import DEFAULT_HINT
from rrfp.core.policy import DEFAULT_DISPATCH
from rrfp.pipeline.schedule_settings import DEFAULT_WEIGHT_SPLIT
from rrfp.pipelining.schedule import ScheduleReady
from rrfp.titan.deferred import DeferredReady

log = logging.getLogger("rrfp.titan")


def pipeline_ready(
    model: torch.nn.Module,
    *,
    parallel_dims,
    parallelism,
    parallelize_fn: Callable,
    loss_fn,
    pipelining_fn: Callable = pipeline_llm,
    **kwargs,
) -> tuple[DeferredReady, list[torch.nn.Module], bool, bool]:
    """``pipelining_fn``'s model parts and first/last flags, with a ScheduleReady (built at the
    first step: rrfp/titan/deferred.py) in place of the torch schedule it returns, made from it:
    the same stages, microbatch count, loss function and ``scale_grads``, and its CSV
    (``parallelism.pipeline_parallel_schedule_csv``) as rrfp's hint. With activation checkpointing
    (``ac_config``) the backward is not split into B and W.
    The hint, budget, dispatch and weight split are ``parallelism.rrfp_hint``, ``rrfp_budget``,
    ``rrfp_dispatch`` and ``rrfp_weight_split`` (rrfp/titan/config.py), or rrfp's defaults when
    the section lacks them.
    Collective: every pp rank calls it, as torchtitan's Trainer does."""
    if isinstance(loss_fn, ChunkedLossWrapper):
        raise NotImplementedError(
            "rrfp.titan: the chunked loss (ChunkedLossWrapper) runs the LM head's backward inside "
            "the loss call, out of the pipeline schedule's reach; use the loss it wraps "
            "(rrfp.titan.with_ready_schedule does)"
        )
    torch_schedule, parts, has_first, has_last = pipelining_fn(
        model,
        parallel_dims=parallel_dims,
        parallelism=parallelism,
        parallelize_fn=_fsdp_left_out(parallelize_fn, parallel_dims),
        loss_fn=loss_fn,
        **kwargs,
    )
    stages = list(getattr(torch_schedule, "_stages", None) or [torch_schedule._stage])
    hint = getattr(parallelism, "rrfp_hint", DEFAULT_HINT)
    # torch's activation checkpointing lets a region be backpropagated once ("Trying to backward
    # an extra time", torch/utils/checkpoint.py): B and W apart would be twice, so B stays whole
    split = False if kwargs.get("ac_config") is not None else None

    def build() -> ScheduleReady:
        schedule = ScheduleReady(
            stages if len(stages) > 1 else stages[0],
            torch_schedule._n_microbatches,
            loss_fn=torch_schedule._loss_fn,
            scale_grads=torch_schedule.scale_grads,
            hint=hint,
            budget=getattr(parallelism, "rrfp_budget", DEFAULT_BUDGET),
            dispatch=getattr(parallelism, "rrfp_dispatch", DEFAULT_DISPATCH),
            split=split,
            weight_split=getattr(parallelism, "rrfp_weight_split", DEFAULT_WEIGHT_SPLIT),
        )
        if parallelism.pipeline_parallel_schedule_csv:
            schedule.load_csv(parallelism.pipeline_parallel_schedule_csv)
        return schedule

    log.info(
        "rrfp.titan: stages %s on this rank (placed for torchtitan's %s), %d microbatches, "
        "ScheduleReady with hint %s%s",
        [s.stage_index for s in stages],
        parallelism.pipeline_parallel_schedule,
        torch_schedule._n_microbatches,
        hint,
        ", backward whole (activation checkpointing)" if split is False else "",
    )
    return DeferredReady(build), parts, has_first, has_last


def _fsdp_left_out(parallelize_fn: Callable, parallel_dims) -> Callable:
    """``parallelize_fn`` without its FSDP wrapping when nothing is data-parallel.

    torchtitan's parallelize functions call ``apply_fsdp_to_decoder`` even at data-parallel degree
    1, where ``fully_shard`` shards over one rank and only installs the mixed-precision policy;
    ScheduleReady refuses an FSDP-wrapped stage module (rrfp/pipeline/wrapped.py), so at degree 1
    it is left out and the stages compute in ``training.dtype``. With data parallelism the wrapping
    stays and ScheduleReady's refusal names it."""
    if (
        parallel_dims.dp_enabled
        or parallel_dims.cp_enabled
        or "apply_fsdp_to_decoder" not in getattr(parallelize_fn, "__globals__", {})
    ):
        return parallelize_fn

    def parallelize(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
        training = kwargs.get("training")
        if training is not None and training.mixed_precision_param != training.dtype:
            log.warning(
                "rrfp.titan: at data-parallel degree 1 the stages compute in training.dtype = %s, "
                "not training.mixed_precision_param = %s (FSDP's policy, which is left out)",
                training.dtype,
                training.mixed_precision_param,
            )
        with _without(parallelize_fn.__globals__, "apply_fsdp_to_decoder"):
            return parallelize_fn(model, **kwargs)

    return parallelize


@contextlib.contextmanager
def _without(namespace: dict, name: str) -> Iterator[None]:
    """``namespace[name]`` a no-op meanwhile."""
    original = namespace[name]
    namespace[name] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        namespace[name] = original
