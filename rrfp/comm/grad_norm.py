"""The gradient norm of the whole model, computed across the pipeline, and clipping by it.

Each rank adds up what it ``counts`` (its share of the model: every parameter of the whole
model counted by exactly one rank) and one all-reduce over the world sums the shares, so the
total is what ``torch.nn.utils.clip_grad_norm_`` on the whole model on one process would find,
the same on every rank. Every rank then scales every gradient it holds (``scaled``) by that
total. A non-finite total is returned and not applied: the gradients stay as they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rrfp.comm.collectives import all_reduce
from rrfp.loop.completions import CompletionPoller

log = logging.getLogger("rrfp.comm.grad_norm")


def _grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]


def local_share(counts: Sequence[torch.nn.Parameter], norm_type: float) -> torch.Tensor:
    """This rank's share, on the CPU in float64: max |g| for ``inf``, else the sum of |g|^p."""
    grads = _grads(counts)
    if not grads:
        return torch.zeros(1, dtype=torch.float64)
    norms = torch.stack(
        [torch.linalg.vector_norm(g.detach(), norm_type).to(torch.float64) for g in grads]
    )
    share = norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()
    return share.reshape(1).cpu()


async def clip_grad_norm(
    poller: CompletionPoller,
    counts: Sequence[torch.nn.Parameter],
    scaled: Sequence[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    group=None,
    what: str = "gradient norm",
) -> float:
    """The total ``norm_type`` norm of the gradients (a float, the same on every rank of ``group``,
    the world when None), and every gradient of ``scaled`` clipped to ``max_norm`` by it."""
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    if not (max_norm >= 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm must be a finite number >= 0, got {max_norm}")
    share = local_share(counts, norm_type)
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    await all_reduce(poller, share, f"all-reduce of the {what}", op, group)
    total = share.item() if math.isinf(norm_type) else share.item() ** (1.0 / norm_type)
    if not math.isfinite(total):
        log.warning("rank %d: the %s is %s: gradients not clipped", dist.get_rank(), what, total)
        return total
    grads = _grads(scaled)
    if grads:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in scaled if p.grad is not None],
            max_norm,
            torch.tensor(total, dtype=torch.float64),
        )
    return total
