"""weight_split="layers" (split-aware layers queue their own W, autograd splits the rest) against
plain autograd on graphs it used to get wrong, and its one clear refusal."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from harness.weight_split_hooks import count_hooks
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from rrfp.nn.split_linear import SplitLinear
from rrfp.pipeline.split_backward import weight_split
from rrfp.pipeline.worker import StageWorker

D, M = 4, 2


class OnBuffer(nn.Module):
    """A split-aware layer whose input is a buffer: its node lies on no path to the stage input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.proj = SplitLinear(D, D), SplitLinear(D, D)
        self.register_buffer("pos", torch.randn(3, D))

    def forward(self, x):
        return self.lin(x) + self.proj(self.pos)


class TiedTranspose(nn.Module):
    """A split-aware layer's weight also used by a plain op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = SplitLinear(D, D)

    def forward(self, x):
        return F.linear(torch.tanh(self.lin(x)), self.lin.weight.t())


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = SplitLinear(D, D)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))) + self.lin(x)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = SplitLinear(D, D), SplitLinear(D, D)

    def forward(self, x):
        return self.l2(self.l1(x).relu_())


class WeightNormed(nn.Module):
    """A split-aware layer with a computed (parametrized) weight: it has no .grad to queue into."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(SplitLinear(D, D))
        self.out = SplitLinear(D, D)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = SplitLinear(D, D), SplitLinear(D, D)

    def forward(self, x):
        return self.l2(checkpoint(lambda h: torch.tanh(self.l1(h)), x, use_reentrant=False))


def mse(out, target):
    return ((out - target) ** 2).mean()


def run_both(make, position: int):
    """The stage under mode "layers" (all F, all B, W reversed) and plain autograd on a copy."""
    torch.manual_seed(0)
    module = make().double()
    ref = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) for _ in range(M)]
    gs = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) for _ in range(M)]
    calls, ref_calls = (
        {},
        {},
    )  # post-accumulate-grad hooks: once per microbatch, as plain autograd runs them
    count_hooks(module, calls)
    count_hooks(ref, ref_calls)
    w = StageWorker(module, position, 3, M, mse, split=True, weight_split="layers")
    for mb in range(M):
        w.forward(mb, xs[mb], gs[mb] if position == 2 else None)
    got = [w.backward(mb, None if position == 2 else gs[mb]) for mb in range(M)]
    for mb in reversed(range(M)):
        w.weight(mb)
    for mb in range(M):
        x = xs[mb].clone().requires_grad_(position > 0)
        out = ref(x)
        (mse(out, gs[mb]) / M if position == 2 else (out * gs[mb]).sum()).backward()
        if position > 0:
            torch.testing.assert_close(got[mb], x.grad, rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert calls == ref_calls, (calls, ref_calls)


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("make", [OnBuffer, TiedTranspose, Twice, InPlace, WeightNormed])
def test_layers_mode_matches_autograd(make, position, caplog):
    caplog.set_level(logging.WARNING, logger="rrfp.pipeline.split_backward.weight_split")
    weight_split._warned.clear()
    run_both(make, position)
    if make is Twice:  # its W is the layer's own queue, not B: nothing to announce
        assert not [r for r in caplog.records if "in B, not W" in r.getMessage()]


@pytest.mark.parametrize("position", [0, 1, 2])
def test_layers_mode_refuses_a_non_reentrant_checkpoint_with_one_clear_error(position):
    with pytest.raises(
        RuntimeError,
        match=rf"stage {position}: [BW]\d: weight_split='layers' cannot run "
        r"split-aware layers inside torch.utils.checkpoint",
    ):
        run_both(Checkpointed, position)
