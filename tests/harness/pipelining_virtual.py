"""Virtual stages under ScheduleReady: which stages torch's placement puts on a rank, and the
single-process reference their losses and gradients are compared with."""

from __future__ import annotations

import torch

from harness.pipelining_model import BATCH, full_model, loss_fn

V = 2


TOL = 1e-10


def held_stages(rank: int, world: int, placement: str) -> tuple[int, ...]:
    """Global stages torch's schedule puts on ``rank``: interleaved r, r + S; v r, 2S - 1 - r."""
    return (rank, rank + world) if placement == "interleaved" else (rank, 2 * world - 1 - rank)


def reference(num_stages: int, stages, x, y) -> tuple[list[float], dict, torch.Tensor]:
    """One process: per-microbatch losses (of BATCH rows each), the mean loss's gradients of
    ``stages`` keyed (stage, name), and the output."""
    model = full_model(num_stages)
    losses = [loss_fn(model(x[i : i + BATCH]), y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    (sum(losses) / len(losses)).backward()
    return (
        [loss.item() for loss in losses],
        {(s, n): p.grad.clone() for s in stages for n, p in model[s].named_parameters()},
        model(x).detach(),
    )


def loss_diff(a: list[float], b: list[float]) -> float:
    """The largest difference of two runs' losses; infinite when one has losses the other lacks."""
    return (
        max((abs(x - y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else float("inf")
    )
