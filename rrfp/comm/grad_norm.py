"""The gradient norm of the whole model, computed across the pipeline, and clipping by it.

Each rank adds up what it ``counts`` (its share of the model: every parameter of the whole
model counted by exactly one rank) and one all-reduce over the world sums the shares, so the
total is what ``torch.nn.utils.clip_grad_norm_`` on the whole model on one process would find,
the same on every rank. Every rank then scales every gradient it holds (``scaled``) by that
total. A non-finite total is returned and not applied: the gradients stay as they are.
An FSDP-sharded gradient (a DTensor) counts and is scaled by this rank's shard, its local tensor:
the ranks of its mesh count its other shards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rrfp.comm.collectives import all_reduce
from rrfp.comm.loaded_class import DTENSOR, loaded_class
from rrfp.loop.completions import CompletionPoller

log = logging.getLogger("rrfp.comm.grad_norm")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, loaded_class(DTENSOR)) else tensor


def _grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [
        p.grad.to_dense() if p.grad.is_sparse else local(p.grad)
        for p in params
        if p.grad is not None
    ]


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
    clip_with_norm(scaled, max_norm, total)
    return total


def clip_with_norm(scaled: Sequence[torch.nn.Parameter], max_norm: float, total: float) -> None:
    """Scale every gradient of ``scaled`` by ``max_norm / total`` when that is below 1: clipping
    by a total norm already summed over the ranks (``local_share`` and one all-reduce)."""
    grads = _grads(scaled)
    if grads:
        dtensor = loaded_class(DTENSOR)
        sharded = [p for p in scaled if p.grad is not None and isinstance(p.grad, dtensor)]
        plain = [p for p in scaled if p.grad is not None and not isinstance(p.grad, dtensor)]
        norm = torch.tensor(total, dtype=torch.float64)
        if plain:
            torch.nn.utils.clip_grads_with_norm_(plain, max_norm, norm)
        if sharded:  # each shard in place, by the same coefficient (clip_grads_with_norm_'s)
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in sharded:
                local(p.grad).mul_(coef.to(p.grad.dtype))
