"""The routers' load-balancing loss, carried into the gradients where each MoE layer runs.

Under pipeline parallelism the loss function sees only the last stage's output, so an auxiliary
loss computed inside an earlier stage's layer cannot be added to it. As Megatron-LM's
``MoEAuxLossAutoScaler`` does, each layer instead passes its output through ``inject``: the
identity in forward, and in backward it hands the auxiliary loss the gradient it would have got
had it been added to the trained loss, ``d(total)/d(aux) = scale``. The whole-model loss this
reproduces is, per microbatch, ``loss_fn(output) + sum over layers of coeff * aux``; the pipeline
divides each microbatch's loss by the number of microbatches M, so the scale is ``1 / M``, set by
the stage worker around each forward with ``aux_loss_scale`` (read at forward time, as the split
backward's queue is: backward runs on autograd's threads).

``collect_aux_losses`` is the other way, for a one-process reference: the layers append their
weighted auxiliary losses (with their graphs) to a list instead, and the caller adds them to the
loss itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("rrfp_aux_loss_scale", default=1.0)
_COLLECT: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "rrfp_aux_loss_collect", default=None
)


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Forwards run inside give their auxiliary losses the gradient ``scale`` (the factor the
    trained loss of their microbatch is multiplied by: ``1 / M`` under the pipeline)."""
    token = _SCALE.set(scale)
    try:
        yield
    finally:
        _SCALE.reset(token)


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[list[torch.Tensor]]:
    """Forwards run inside append their weighted auxiliary losses to the yielded list (graphs
    kept) instead of injecting their gradients: the caller adds them to its loss."""
    found: list[torch.Tensor] = []
    token = _COLLECT.set(found)
    try:
        yield found
    finally:
        _COLLECT.reset(token)


class _Inject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def inject(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged; in backward, ``aux_loss`` (a scalar with a graph) gets the gradient
    the scale in force at this forward says. Under ``collect_aux_losses`` it is appended to the
    list instead."""
    found = _COLLECT.get()
    if found is not None:
        found.append(aux_loss)
        return output
    if not aux_loss.requires_grad:
        return output
    return _Inject.apply(output, aux_loss, _SCALE.get())
