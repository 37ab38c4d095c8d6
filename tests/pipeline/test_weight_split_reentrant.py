"""A stage with torch.utils.checkpoint(use_reentrant=True) inside: torch refuses its backward under
torch.autograd.grad, so the split backward leaves that stage unsplit (B does B + W, W nothing),
says so once naming the stage, and matches plain autograd. A first stage's W is its whole backward
(torch.autograd.backward, which runs the checkpoint): it stays as it is, and nothing is said."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rrfp.pipeline.worker import StageWorker

D, V = 6, 7


class Stage(nn.Module):
    def __init__(self, first: bool, reentrant: bool) -> None:
        super().__init__()
        self.first, self.reentrant = first, reentrant
        self.emb = nn.Embedding(V, D)
        self.block = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.emb(x) if self.first else x
        return self.head(checkpoint(self.block, h, use_reentrant=self.reentrant))


def mse(out, target):
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize("position", [0, 1, 2])
def test_reentrant_checkpoint_stage_runs_unsplit_and_matches_autograd(position, caplog):
    m = 2
    torch.manual_seed(0)
    module = Stage(position == 0, reentrant=True).double()
    ref = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(1)
    xs = [
        torch.randint(0, V, (3, 4), generator=gen)
        if position == 0
        else torch.randn(3, 4, D, generator=gen, dtype=torch.float64)
        for _ in range(m)
    ]
    gs = [torch.randn(3, 4, D, generator=gen, dtype=torch.float64) for _ in range(m)]
    caplog.set_level(logging.WARNING, logger="rrfp.pipeline.worker")
    w = StageWorker(module, position, 3, m, mse, split=True)
    for mb in range(m):
        w.forward(mb, xs[mb], gs[mb] if position == 2 else None)
    got_in = [w.backward(mb, None if position == 2 else gs[mb]) for mb in range(m)]
    after_b = {
        n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()
    }  # B did all
    for mb in range(m):
        w.weight(mb)
    for mb in range(m):
        x = xs[mb] if position == 0 else xs[mb].clone().requires_grad_(True)
        out = ref(x)
        (mse(out, gs[mb]) / m if position == 2 else (out * gs[mb]).sum()).backward()
        if position > 0:
            torch.testing.assert_close(got_in[mb], x.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        if q.grad is None:  # the embedding off the first stage
            assert p.grad is None and after_b[name] is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
        if position == 0:  # B had nothing to compute: W ran the whole backward
            assert after_b[name] is None, f"B computed {name}"
        else:
            assert torch.equal(p.grad, after_b[name]), f"W changed {name}"
    lines = [r.getMessage() for r in caplog.records if "reentrant" in r.getMessage()]
    if position == 0:
        assert lines == [] and w.split_summary().in_b == {}, (lines, w.split_summary())
        return
    assert (
        len(lines) == 1
        and lines[0].startswith(f"stage {position}:")
        and "use_reentrant=False" in lines[0]
    ), lines
    assert set(w.split_summary().in_b) == {n for n, _ in module.named_parameters()}


def test_non_reentrant_checkpoint_is_still_split():
    torch.manual_seed(0)
    module = Stage(False, reentrant=False).double()
    w = StageWorker(module, 1, 3, 1, None, split=True)
    x = torch.randn(3, 4, D, dtype=torch.float64)
    w.forward(0, x)
    w.backward(0, torch.randn(3, 4, D, dtype=torch.float64))
    assert all(p.grad is None for p in module.parameters()), "B computed a weight gradient"
    w.weight(0)
    assert all(p.grad is not None for n, p in module.named_parameters() if not n.startswith("emb."))
    assert w.split_summary().in_b == {}
