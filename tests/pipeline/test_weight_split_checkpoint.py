"""torch.utils.checkpoint(use_reentrant=False) under the split backward: B recomputes each
checkpointed region once and W once more for all its calls (one GraphExecGroup), gradients and
post-accumulate-grad hooks as plain autograd. A stage whose W would run a checkpointed node twice (a
parameter's uses gathered through the region) runs its backward unsplit and says so once."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from harness.split_mode import ops_through_the_mode
from harness.weight_split_hooks import count_hooks
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from rrfp.pipeline.worker import StageWorker

D, V, M = 6, 7, 2


def mse(out, target):
    return ((out - target) ** 2).mean()


class Block(nn.Module):
    """A pre-norm residual MLP; ``runs`` counts its forward and every recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Stage(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.emb(x) if self.first else x
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False)
        return self.head(h)


class TwiceInRegion(nn.Module):
    """One Linear applied twice inside the region: its weight is gathered use by use, but through
    nodes that hold no checkpointed tensor (each use transposes the weight on its own), so W stays
    split."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.shared = nn.Linear(D, D), nn.Linear(D, D)
        self.runs = 0

    def region(self, x):
        self.runs += 1
        return self.shared(torch.tanh(self.shared(torch.tanh(self.a(x)))))

    def forward(self, x):
        return checkpoint(self.region, x, use_reentrant=False)


class ChunkedInRegion(nn.Module):
    """One parameter split in two inside the region, its halves used at two matmuls: gathering their
    uses would run the region's tanh (a checkpointed node) once per use, and the lower matmul
    again."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(2 * D, D) / D)
        self.head = nn.Linear(D, D)
        self.runs = 0

    def region(self, x):
        self.runs += 1
        w1, w2 = torch.tanh(self.p).chunk(2)
        return torch.tanh(x @ w1) @ w2

    def forward(self, x):
        return self.head(checkpoint(self.region, x, use_reentrant=False))


def data(position: int):
    gen = torch.Generator().manual_seed(1)
    xs = [
        torch.randint(0, V, (3, 4), generator=gen)
        if position == 0
        else torch.randn(3, 4, D, generator=gen, dtype=torch.float64)
        for _ in range(M)
    ]
    gs = [torch.randn(3, 4, D, generator=gen, dtype=torch.float64) for _ in range(M)]
    return xs, gs


def check_against_autograd(module, ref, position, xs, gs, got_in, calls, ref_calls) -> None:
    for mb in range(M):
        x = xs[mb] if position == 0 else xs[mb].clone().requires_grad_(True)
        out = ref(x)
        (mse(out, gs[mb]) / M if position == 2 else (out * gs[mb]).sum()).backward()
        if position > 0:
            torch.testing.assert_close(got_in[mb], x.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        if q.grad is None:  # the embedding off the first stage
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert calls == ref_calls, (calls, ref_calls)


@pytest.mark.parametrize("weight_split", ["autograd", "functions"])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_w_recomputes_each_region_once_per_microbatch(position, weight_split):
    """W recomputes each region once for all its restarts (mode autograd); in mode functions the
    blocks' norm and linears queue their W in B, from what B's one recomputation unpacked, so W
    recomputes nothing, except on the first stage, whose W is its whole backward."""
    torch.manual_seed(0)
    module = Stage(position == 0).double()
    ref = copy.deepcopy(module)
    xs, gs = data(position)
    calls, ref_calls = {}, {}
    count_hooks(module, calls)
    count_hooks(ref, ref_calls)
    w = StageWorker(module, position, 3, M, mse, split=True, weight_split=weight_split)
    runs = lambda: [b.runs for b in module.blocks]  # noqa: E731
    for mb in range(M):
        w.forward(mb, xs[mb], gs[mb] if position == 2 else None)
    assert runs() == [M, M]
    in_w = 1 if weight_split == "autograd" or position == 0 else 0
    got_in = []
    for mb in range(M):
        before = runs()
        got_in.append(w.backward(mb, None if position == 2 else gs[mb]))
        # B asks for the input gradient only: the first stage has none, so nothing to recompute
        assert [r - b for r, b in zip(runs(), before)] == [0 if position == 0 else 1] * 2, f"B{mb}"
    for mb in range(M):
        before = runs()
        w.weight(mb)
        assert [r - b for r, b in zip(runs(), before)] == [in_w, in_w], (
            f"W{mb} recomputed a region {runs()[0] - before[0]} times"
        )
    assert w.split_summary().in_b == {}
    check_against_autograd(module, ref, position, xs, gs, got_in, calls, ref_calls)


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_split_functions_recompute_no_more_than_the_unsplit_backward():
    """A checkpoint's recomputation stops once the region's last saved tensor is saved again, so
    the unsplit backward never recomputes a region's last product (each block's ``down``). B + W
    under the split-aware functions computes the same FLOPs: the split linear saves its input
    before its product, as torch's own ops do, and the recomputation stops there too."""
    torch.manual_seed(0)
    module = Stage(False).double()
    ref = copy.deepcopy(module)
    xs, gs = data(1)
    split = StageWorker(module, 1, 3, 1, mse, split=True, weight_split="functions")
    unsplit = StageWorker(ref, 1, 3, 1, mse, split=False)
    split.forward(0, xs[0])
    unsplit.forward(0, xs[0])
    b = flops(lambda: split.backward(0, gs[0]))
    w = flops(lambda: split.weight(0))
    whole = flops(lambda: unsplit.backward(0, gs[0]))
    n = 3 * 4  # rows
    head, up, down = 2 * n * D * D, 2 * n * D * 2 * D, 2 * n * 2 * D * D  # each product's FLOPs
    # every product's two gradients, and each block's recomputation: its up, not its down
    assert whole == 2 * (head + 2 * (up + down)) + 2 * up, whole
    assert b + w == whole, (b, w, whole)


class ScaledStage(Stage):
    """Stage with a weight applied as a bare product: outside every split-aware module, so the
    split-aware functions reach it only by intercepting the ops (the torch-function mode)."""

    def __init__(self, first: bool) -> None:
        super().__init__(first)
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("stage", [Stage, ScaledStage])
def test_only_a_bare_parameter_makes_ops_dispatch_through_the_mode_and_never_in_w(
    stage, monkeypatch
):
    """Where every parameter sits in a linear, norm or embedding module, the modules split their
    own ops and no op dispatches through the torch-function mode (Python, per op). A weight
    outside them needs the mode in F and in B's recomputation; W recomputes nothing, so its
    closures run outside it either way."""
    seen = ops_through_the_mode(monkeypatch)
    module = stage(False).double()
    xs, gs = data(1)
    w = StageWorker(module, 1, 3, 1, mse, split=True, weight_split="functions")
    w.forward(0, xs[0])
    in_f = len(seen)
    w.backward(0, gs[0])
    if stage is Stage:
        assert seen == [], seen[:5]
    else:
        assert in_f and len(seen) > in_f, "F or B's recomputation ran outside the mode"
    seen.clear()
    w.weight(0)
    used = [p for n, p in module.named_parameters() if not n.startswith("emb.")]
    assert seen == [] and all(p.grad is not None for p in used), seen[:5]
    assert w.split_summary().in_b == {}, w.split_summary()


def test_gathering_outside_checkpointed_nodes_stays_split(caplog):
    torch.manual_seed(0)
    module = TwiceInRegion().double()
    ref = copy.deepcopy(module)
    xs, gs = data(1)
    calls, ref_calls = {}, {}
    count_hooks(module, calls)
    count_hooks(ref, ref_calls)
    caplog.set_level(logging.WARNING, logger="rrfp.pipeline.worker")
    w = StageWorker(module, 1, 3, M, mse, split=True)
    for mb in range(M):
        w.forward(mb, xs[mb])
    got_in = [w.backward(mb, gs[mb]) for mb in range(M)]
    assert module.shared.weight.grad is None, "B computed the gathered weight's gradient"
    before = module.runs
    for mb in range(M):
        w.weight(mb)
    assert module.runs - before == M, "W recomputed the region more than once per microbatch"
    assert "shared.weight" not in w.split_summary().in_b
    assert not [r for r in caplog.records if r.name == "rrfp.pipeline.worker"]
    check_against_autograd(module, ref, 1, xs, gs, got_in, calls, ref_calls)


@pytest.mark.parametrize("position", [1, 2])
def test_gathering_through_checkpointed_nodes_runs_unsplit_and_warns_once(position, caplog):
    torch.manual_seed(0)
    module = ChunkedInRegion().double()
    ref = copy.deepcopy(module)
    xs, gs = data(position)
    calls, ref_calls = {}, {}
    count_hooks(module, calls)
    count_hooks(ref, ref_calls)
    caplog.set_level(logging.WARNING, logger="rrfp.pipeline.worker")
    w = StageWorker(module, position, 3, M, mse, split=True)
    for mb in range(M):
        w.forward(mb, xs[mb], gs[mb] if position == 2 else None)
    got_in = [w.backward(mb, None if position == 2 else gs[mb]) for mb in range(M)]
    assert all(p.grad is not None for p in module.parameters()), "B left weight gradients to W"
    after_b = {n: p.grad.clone() for n, p in module.named_parameters()}
    for mb in range(M):
        w.weight(mb)
    assert all(torch.equal(p.grad, after_b[n]) for n, p in module.named_parameters()), (
        "W ran after all"
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "rrfp.pipeline.worker"]
    assert (
        len(lines) == 1
        and lines[0].startswith(f"stage {position}:")
        and "GraphExecGroup" in lines[0]
    ), lines
    assert set(w.split_summary().in_b) == {n for n, _ in module.named_parameters()}
    check_against_autograd(module, ref, position, xs, gs, got_in, calls, ref_calls)
