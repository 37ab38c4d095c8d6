"""rrfp's keys in a torchtitan config, and a torchtitan config turned into one that runs them.

The keys live in the ``parallelism`` section because that section is what torchtitan hands its
pipelining function (``ModelSpec.pipelining_fn``); tyro reads the subclass's fields, so
``--parallelism.rrfp_hint zbh1`` works on torchtitan's command line like any other key.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config import ParallelismConfig
from torchtitan.trainer import Trainer

from rrfp.core.budget import DEFAULT_BUDGET
from rrfp.core.hints import DEFAULT_HINT
from rrfp.core.policy import DEFAULT_DISPATCH
from rrfp.pipeline.schedule_settings import DEFAULT_WEIGHT_SPLIT, ScheduleSettings
from rrfp.titan.pipelining import pipeline_ready

log = logging.getLogger("rrfp.titan")


@dataclass(kw_only=True, slots=True)
class ReadyParallelism(ParallelismConfig):
    """torchtitan's parallelism section with rrfp's schedule keys."""

    rrfp_hint: str = DEFAULT_HINT
    """rrfp's hint: the order it prefers among ready tasks (bfw, 1f1b, zbh1, gpipe, bf, plan; zbv
    with a V schedule such as ZBVZeroBubble), or a .csv file or module:function."""

    rrfp_budget: str = DEFAULT_BUDGET
    """Microbatches in flight per stage: 2x (twice 1F1B's), a count, or bytes such as 512MiB."""

    rrfp_dispatch: str = DEFAULT_DISPATCH.value
    """ready: run whichever task is ready, in the hint's order; fixed: the hint's order exactly."""

    rrfp_weight_split: str = DEFAULT_WEIGHT_SPLIT
    """How a split backward leaves weight gradients to W: auto (the split-aware functions where
    they apply), autograd (the generic split: torchtitan's own backward ops, so the same float32
    rounding as torchtitan's schedules), functions."""

    def __post_init__(self) -> None:
        post_init = getattr(ParallelismConfig, "__post_init__", None)
        if post_init is not None:  # not super(): a slots dataclass is a new class
            post_init(self)
        for key, setting in (
            ("rrfp_hint", {"hint": self.rrfp_hint}),
            ("rrfp_budget", {"budget": self.rrfp_budget}),
            ("rrfp_dispatch", {"dispatch": self.rrfp_dispatch}),
            ("rrfp_weight_split", {"weight_split": self.rrfp_weight_split}),
        ):
            try:
                ScheduleSettings.of(1, **setting)
            except ValueError as e:
                raise ValueError(f"parallelism.{key}: {e}") from None


@dataclass(kw_only=True, slots=True)
class ReadyTrainerConfig(Trainer.Config):
    """torchtitan's trainer config whose parallelism section has rrfp's keys; it builds torchtitan's
    own Trainer."""

    parallelism: ReadyParallelism = field(default_factory=ReadyParallelism)


def with_ready_schedule(config: Trainer.Config) -> ReadyTrainerConfig:
    """``config`` as a ReadyTrainerConfig whose model spec pipelines with rrfp (``pipeline_ready``
    around the spec's own pipelining function, so its split and placement are kept).

    The chunked loss (``ChunkedLossWrapper``) is replaced by the loss it wraps: it runs the LM head
    and its backward inside the loss call, chunk by chunk, so rrfp's executor would neither see
    that backward nor scale it with the rest; the unchunked loss is the same number with the
    logits of a microbatch held whole."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    parallelism = config.parallelism
    if not isinstance(parallelism, ReadyParallelism):
        parallelism = ReadyParallelism(
            **{f.name: getattr(parallelism, f.name) for f in dataclasses.fields(parallelism)}
        )
    values["parallelism"] = parallelism
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        values["loss"] = config.loss.loss_fn
    spec = config.model_spec
    if spec is not None and spec.pipelining_fn is not None:
        original = spec.pipelining_fn
        if not (isinstance(original, functools.partial) and original.func is pipeline_ready):
            spec = dataclasses.replace(
                spec, pipelining_fn=functools.partial(pipeline_ready, pipelining_fn=original)
            )
    values["model_spec"] = spec
    return ReadyTrainerConfig(**values)
