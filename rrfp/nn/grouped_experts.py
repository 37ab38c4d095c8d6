"""A mixture of experts' routed experts, each a SwiGLU MLP, computed grouped.

The experts' weights are stacked, ``w1`` and ``w3`` [E, hidden, dim] and ``w2`` [E, dim, hidden]
(expert e: ``w2[e] @ (silu(w1[e] x) * w3[e] x)``), and the token copies arrive sorted by expert
with their counts per expert, so each of the three products is one grouped matrix product over
contiguous row groups: ``torch._grouped_mm`` where this build and dtype have it (CPU: float32,
bfloat16, float16; CUDA: bfloat16), a loop over the experts otherwise (float64 always loops).

Like ``SplitLinear``, each grouped product is split-aware: under an active weight-gradient queue
(rrfp's split backward, mode "layers") its backward returns the input gradient at once and queues
the weight gradient for W, so the experts' weight gradients belong to W.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from rrfp.nn.grad_accumulation import accumulate_grad
from rrfp.nn.split_linear import WeightGradQueue, active_queue

_GROUPED_CPU = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fits(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: a build that has it, a dtype it has on
    their device, and rows whose strides are multiples of 16 bytes (its alignment rule)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    first = tensors[0]
    ok = _GROUPED_CPU if first.device.type == "cpu" else (torch.bfloat16,)
    if first.dtype not in ok or first.device.type not in ("cpu", "cuda"):
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0).to(torch.int32)


def _groups(rows: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return rows.split(sizes, dim=0)


def grouped_forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row group e of ``x`` times ``weight[e]`` transposed: [T, in] x [E, out, in] -> [T, out]."""
    if grouped_mm_fits(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=_offsets(counts))
    parts = [xe @ weight[e].t() for e, xe in enumerate(_groups(x, counts.tolist()))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def grouped_input_grad(g: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row group e of ``g`` times ``weight[e]``: [T, out] x [E, out, in] -> [T, in]."""
    if grouped_mm_fits(g, weight):
        return torch._grouped_mm(g, weight, offs=_offsets(counts))
    parts = [ge @ weight[e] for e, ge in enumerate(_groups(g, counts.tolist()))]
    return torch.cat(parts) if parts else g.new_zeros(0, weight.shape[2])


def grouped_weight_grad(g: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per group e, ``g_e.T @ x_e``: [T, out], [T, in] -> [E, out, in] (zero for an empty group)."""
    if grouped_mm_fits(g, x):
        return torch._grouped_mm(g.t(), x, offs=_offsets(counts))
    sizes = counts.tolist()
    return torch.stack(
        [ge.t() @ xe for ge, xe in zip(_groups(g, sizes), _groups(x, sizes), strict=True)]
    )


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, queue):
        ctx.save_for_backward(x, weight, counts)
        ctx.param, ctx.queue = weight, queue  # a leaf parameter: referencing it makes no cycle
        return grouped_forward(x, weight, counts)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, counts = ctx.saved_tensors
        grad_x = grouped_input_grad(grad_out, weight, counts) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            if ctx.queue is None:
                grad_w = grouped_weight_grad(grad_out, x, counts)
            else:
                ctx.queue.append(_weight_grad_closure(grad_out, x, counts, ctx.param))
        return grad_x, grad_w, None, None


def _weight_grad_closure(g, x, counts, param) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            accumulate_grad(param, grouped_weight_grad(g, x, counts), owned=True)

    return run


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_forward`` with autograd; under an active weight-gradient queue (and grad mode,
    with a leaf weight) the weight gradient is deferred to W."""
    queue: WeightGradQueue | None = active_queue()
    if queue is not None and not (torch.is_grad_enabled() and weight.grad_fn is None):
        queue = None
    return _GroupedLinearFn.apply(x, weight, counts, queue)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``hidden_dim`` over ``dim``-wide tokens."""

    defers_weight_grad = True  # under a split backward its parameters' gradients are final after W

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        for name, v in (("num_experts", num_experts), ("dim", dim), ("hidden_dim", hidden_dim)):
            if v <= 0:
                raise ValueError(f"GroupedExperts.{name} must be positive, got {v}")
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as nn.Linear initialises them (uniform, bound 1/sqrt(fan_in))."""
        with torch.no_grad():
            for w in (self.w1, self.w2, self.w3):
                bound = 1 / math.sqrt(w.shape[-1])
                w.uniform_(-bound, bound)

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x_sorted`` [T, dim], token copies sorted by expert; ``counts`` [E] int64, rows per
        expert (summing to T) -> [T, dim] in the same row order."""
        h = F.silu(grouped_linear(x_sorted, self.w1, counts)) * grouped_linear(
            x_sorted, self.w3, counts
        )
        return grouped_linear(h, self.w2, counts)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"
