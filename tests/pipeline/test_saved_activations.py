"""Measuring activations (byte budgets) must not weaken autograd: a saved tensor changed in place
after F is refused as plain PyTorch refuses it, never turned into a silently wrong gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rrfp.pipeline.worker import StageWorker

D = 4


class ChangesASavedTensor(nn.Module):
    """``l2`` saves ``h`` for its weight gradient; ``h`` is then changed in place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.in_place = nn.Linear(D, D), nn.Linear(D, D), in_place

    def forward(self, x):
        h = self.l1(x)
        y = self.l2(h)
        h = h.add_(1.0) if self.in_place else h + 1.0
        return y + h


def _inputs(in_place: bool):
    torch.manual_seed(0)
    return (
        ChangesASavedTensor(in_place).double(),
        torch.randn(2, 3, D).double(),
        torch.randn(2, 3, D).double(),
    )


def _run(model, x, gy, split: bool, measure: bool):
    """F, B (and W) of one microbatch on a middle stage; the bytes F counted for its slot."""
    worker = StageWorker(model, 1, 3, 1, None, split=split, measure_activations=measure)
    worker.forward(0, x)
    counted = worker.activation_bytes(0)
    worker.backward(0, gy)
    if split:
        worker.weight(0)
    return counted


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("measure", [True, False])
def test_a_saved_tensor_changed_in_place_is_refused_like_plain_autograd(split, measure):
    model, x, gy = _inputs(in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        copy.deepcopy(model)(x.clone().requires_grad_()).backward(gy)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(copy.deepcopy(model), x, gy, split, measure)


@pytest.mark.parametrize("split", [True, False])
def test_measured_activations_give_autograds_gradients(split):
    model, x, gy = _inputs(in_place=False)
    ref = copy.deepcopy(model)
    ref(x.clone().requires_grad_()).backward(gy)
    ours = copy.deepcopy(model)
    counted = _run(ours, x, gy, split, measure=True)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert counted >= x.numel() * x.element_size()  # at least the received input it keeps until B
