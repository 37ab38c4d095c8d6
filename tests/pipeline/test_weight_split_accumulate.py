"""The split backward puts gradients into ``.grad`` as torch's AccumulateGrad does: each parameter
owns its gradient, and its post-accumulate-grad hooks fire once per microbatch (in that
microbatch's B or W), so torch's optimizer-in-backward recipe works. Checked against plain
autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.weight_split_hooks import count_hooks
from torch import nn
from torch.nn import functional as F

from rrfp.nn.split_linear import SplitLinear, WeightGradQueue, accumulate_grad, collect_weight_grads
from rrfp.pipeline.worker import StageWorker

D = 6


class Stage(nn.Module):
    """A weight made of two parameters (autograd hands one tensor to both), a layer applied twice
    (its weight gathered use by use in W, its bias kept in B) and a plain layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(D, D) / D), nn.Parameter(torch.randn(D, D) / D)
        self.shared = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.a + self.b))
        return self.out(self.shared(torch.tanh(self.shared(h))))


def mse(out, target):
    return ((out - target) ** 2).mean()


def data(position: int, m: int):
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(m)]
    grads = [torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(m)]
    return xs, grads


def reference_backward(ref, position: int, x, g, m: int):
    out = ref(x.clone().requires_grad_(position > 0))
    if position == 2:
        (mse(out, g) / m).backward()
    else:
        out.backward(g)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_each_parameter_owns_its_gradient(position):
    """F.linear(x, a + b): autograd returns one tensor for a and b. clip_grad_norm_ scales each
    .grad in place, so a shared tensor would be scaled twice."""
    torch.manual_seed(0)
    module = Stage().double()
    ref = copy.deepcopy(module)
    (x,), (g,) = data(position, 1)
    w = StageWorker(module, position, 3, 1, mse, split=True)
    w.forward(0, x, g if position == 2 else None)
    w.backward(0, None if position == 2 else g)
    w.weight(0)
    reference_backward(ref, position, x, g, 1)
    assert module.a.grad.data_ptr() != module.b.grad.data_ptr()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 0.01)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_post_accumulate_hooks_fire_once_per_microbatch(position):
    """All forwards, then all B, then all W (what plain autograd cannot do in one order): after B(m)
    and W(m) of every microbatch each parameter's hook has run once per microbatch, as plain
    autograd runs it once per backward; B runs those of the parameters it computes, W the rest."""
    m = 3
    torch.manual_seed(0)
    module = Stage().double()
    ref = copy.deepcopy(module)
    calls, ref_calls = {}, {}
    count_hooks(module, calls)
    count_hooks(ref, ref_calls)
    xs, grads = data(position, m)
    w = StageWorker(module, position, 3, m, mse, split=True)
    for mb in range(m):
        w.forward(mb, xs[mb], grads[mb] if position == 2 else None)
    in_b = set(w.split_summary().in_b)
    if position > 0:
        assert in_b == {"shared.bias"}, in_b  # B computes it, so its hook fires in B
    for mb in range(m):
        w.backward(mb, None if position == 2 else grads[mb])
        assert calls == {n: mb + 1 for n in in_b}, (mb, calls)
    for mb in range(m):
        w.weight(mb)
        assert calls == {n: (m if n in in_b else mb + 1) for n, _ in module.named_parameters()}, (
            mb,
            calls,
        )
    for mb in range(m):
        reference_backward(ref, position, xs[mb], grads[mb], m)
    assert calls == ref_calls == {n: m for n, _ in module.named_parameters()}


def optimizer_in_backward(module: nn.Module) -> None:
    """torch's recipe: one optimizer per parameter, stepped by its post-accumulate-grad hook."""
    optimizers = {p: torch.optim.AdamW([p], lr=0.05) for p in module.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(step)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_optimizer_in_backward_matches_plain_autograd(position):
    """F(m) B(m) W(m) per microbatch is an order plain autograd can run (forward, backward per
    microbatch): the parameters after the steps the hooks take are the same."""
    m = 3
    torch.manual_seed(0)
    module = Stage().double()
    ref = copy.deepcopy(module)
    start = copy.deepcopy(module)
    optimizer_in_backward(module)
    optimizer_in_backward(ref)
    xs, grads = data(position, m)
    w = StageWorker(module, position, 3, m, mse, split=True)
    for mb in range(m):
        w.forward(mb, xs[mb], grads[mb] if position == 2 else None)
        w.backward(mb, None if position == 2 else grads[mb])
        w.weight(mb)
        reference_backward(ref, position, xs[mb], grads[mb], m)
    for (name, p), q, p0 in zip(module.named_parameters(), ref.parameters(), start.parameters()):
        assert not torch.equal(p, p0), f"{name} never moved"
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
        assert p.grad is None, name


def test_queue_runs_a_layers_hooks_once_per_microbatch():
    """A split-aware layer applied twice queues two closures in one microbatch: W adds both, then
    runs the hooks once, as plain autograd does for its one backward."""
    torch.manual_seed(0)
    layer = SplitLinear(D, D).double()
    ref = copy.deepcopy(layer)
    calls, ref_calls = {}, {}
    count_hooks(layer, calls)
    count_hooks(ref, ref_calls)
    x = torch.randn(3, D, dtype=torch.float64)
    queue = WeightGradQueue()
    leaf = x.clone().requires_grad_(True)
    with collect_weight_grads(queue):
        out = layer(torch.tanh(layer(leaf)))
    torch.autograd.grad(out.sum(), leaf)  # B: the input's gradient only
    assert len(queue) == 2 and calls == {}
    queue.run()
    ref(torch.tanh(ref(x))).sum().backward()
    assert calls == ref_calls == {"weight": 1, "bias": 1}
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)


def test_accumulate_grad_owns_then_adds_in_place():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    g = torch.ones(3, dtype=torch.float64)
    accumulate_grad(p, g)
    assert p.grad.data_ptr() != g.data_ptr()
    first = p.grad
    accumulate_grad(p, g)
    assert p.grad is first and torch.equal(p.grad, torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.equal(g, torch.ones(3, dtype=torch.float64))


def test_a_hook_that_returns_a_value_is_refused_as_torch_refuses_it():
    p = nn.Parameter(torch.zeros(3))
    p.register_post_accumulate_grad_hook(lambda p: p.grad)
    with pytest.raises(RuntimeError, match="hooks should return None"):  # plain autograd
        p.sum().backward()
    p.grad = None
    with pytest.raises(RuntimeError, match="hooks should return None"):
        accumulate_grad(p, torch.ones(3))


@pytest.mark.parametrize("weight_split", ["autograd", "functions"])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_tensor_hooks_see_each_backward_pass_once_as_autograd_does(position, weight_split):
    """``Tensor.register_hook`` on a parameter: autograd calls it once per backward pass with
    that pass's whole gradient (a layer applied twice: the sum of both uses) and accumulates
    what it returns. B and W together must do the same, whichever computes the parameter."""
    m = 3
    torch.manual_seed(0)
    module = Stage().double()
    ref = copy.deepcopy(module)
    seen: dict[str, list] = {}
    ref_seen: dict[str, list] = {}

    def doubling(mod, log):
        for name, p in mod.named_parameters():
            p.register_hook(
                lambda g, name=name: log.setdefault(name, []).append(g.clone()) or 2 * g
            )

    doubling(module, seen)
    doubling(ref, ref_seen)
    xs, grads = data(position, m)
    w = StageWorker(module, position, 3, m, mse, split=True, weight_split=weight_split)
    for mb in range(m):
        w.forward(mb, xs[mb], grads[mb] if position == 2 else None)
        w.backward(mb, None if position == 2 else grads[mb])
        w.weight(mb)
        reference_backward(ref, position, xs[mb], grads[mb], m)
    # the generic split's W gathers a layer applied twice use by use: torch.autograd.grad calls
    # that weight's hooks once per use (docs/design.md); the split-aware functions sum them first
    per_use = {"shared.weight"} if weight_split == "autograd" and position > 0 else set()
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        assert len(ref_seen[name]) == m, name
        if name in per_use:
            assert len(seen[name]) == 2 * m, name
        else:
            assert len(seen[name]) == m, name
            for got, want in zip(seen[name], ref_seen[name]):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
