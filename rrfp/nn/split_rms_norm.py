"""A split-aware ``F.rms_norm`` (``nn.RMSNorm``, the norms of rrfp's Llama and its MoE blocks).

``F.rms_norm`` is one call that torch runs as a composite of elementwise ops, so an RMSNorm's
weight is out of reach of ``SplitFunctions``' elementwise-product rule and would fall to the
generic split, which restarts autograd at the norm in W. Here the forward is torch's own
(``aten._fused_rms_norm``, which also returns the per-row ``rstd``; torch has no CPU kernel for
its backward), and the backward computes the input gradient and the weight's,
``sum(grad * x * rstd)`` (a reduction: no FLOPs worth deferring), in B, and queues the weight's
accumulation for W.
"""

from __future__ import annotations

import torch

from rrfp.nn.grad_accumulation import queue_accumulation


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, weight, eps, queue):
        out, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape, ctx.queue, ctx.param = shape, queue, weight
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dims, param = tuple(range(-len(ctx.shape), 0)), ctx.param
        x_hat = x * rstd
        grad_x = None
        if ctx.needs_input_grad[0]:
            g_hat = grad * weight
            grad_x = rstd * (g_hat - x_hat * (g_hat * x_hat).mean(dims, keepdim=True))

        queue_accumulation(ctx.queue, [(param, (grad * x_hat).sum_to_size(param.shape))])
        return grad_x, None, None, None, None


def split_rms_norm(queue, x, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` whose weight gradient is queued to ``queue``; NotImplemented (autograd's own)
    without a leaf floating weight of ``x``'s dtype that wants a gradient."""
    if (
        weight is None
        or weight.grad_fn is not None
        or not weight.requires_grad
        or weight.dtype != x.dtype
    ):
        return NotImplemented
    return _RMSNormFn.apply(x, list(normalized_shape), weight, eps, queue), [weight]
