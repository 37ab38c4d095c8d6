"""The learning rate of each optimizer step: a linear warmup from 0, then constant or a cosine or
linear decay to ``min_lr``. A pure function of the step (and the config), so a resumed run, which
knows only its checkpoint's step, continues the schedule exactly: the schedule's position is the
step count the checkpoint already records."""

from __future__ import annotations

import math


def learning_rate(
    step: int,
    lr: float,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_lr: float = 0.0,
    decay_steps: int = 0,
) -> float:
    """The learning rate of (0-based) ``step``: ``lr * step / warmup_steps`` during the warmup,
    then ``lr`` (constant), or a cosine or linear fall from ``lr`` at the warmup's end to
    ``min_lr`` at ``decay_steps``, and ``min_lr`` after it."""
    if step < warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "cosine":
        left = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        left = 1.0 - progress
    else:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    return min_lr + (lr - min_lr) * left


def optim_learning_rate(optim, steps: int, step: int) -> float:
    """``learning_rate`` of ``step`` under an [optim] section, in a run of ``steps`` steps."""
    return learning_rate(
        step,
        optim.lr,
        optim.warmup_steps,
        optim.schedule,
        optim.min_lr,
        optim.decay_steps or steps,
    )
