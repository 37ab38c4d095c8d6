"""Mode "functions" through the stage's own modules (rrfp/nn/split_functions.py, split_modules):
exact linears, norms and embeddings split their ops without the torch-function mode, anything
else keeps its class, a module that owns a bare parameter runs its own forward under the mode,
and a weight that a module owns but a bare op also uses is still exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from harness.split_mode import ops_through_the_mode
from torch import nn

from rrfp.nn.split_functions import SplitFunctions, split_modules
from rrfp.nn.split_linear import WeightGradQueue
from rrfp.pipeline.user_code import module_name
from rrfp.pipeline.worker import StageWorker

D = 5


class MyLinear(nn.Linear):
    """A user's subclass: its forward is its own, so it keeps its class."""

    def forward(self, x):
        return super().forward(x) * 2


class Reused(nn.Module):
    """Every parameter in a linear, norm or embedding module; one weight also used by a bare
    ``F.linear`` outside its module, and one module called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D, bias=False)
        self.rms = nn.RMSNorm(D)

    def forward(self, x):
        h = torch.tanh(self.a(self.norm(x)))
        h = h + F.linear(torch.sin(h), self.a.weight)  # the module's weight, outside the module
        return self.rms(self.b(self.b(h)))


def test_split_modules_swaps_exact_types_only_and_names_a_bare_parameter():
    plain = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Embedding(3, D), nn.RMSNorm(D))
    assert split_modules(plain) is False
    assert split_modules(plain) is False  # again (a worker built again on the same stage)
    assert all(type(m).__name__.startswith("_SplitAware") for m in plain)
    assert all(isinstance(m, t) for m, t in zip(plain, (nn.Linear, nn.LayerNorm, nn.Embedding)))
    # users see the class they wrote: in print(model), and in rrfp's lines about their module
    assert repr(plain[0]).startswith("Linear(") and module_name(plain[1]) == "torch.nn.LayerNorm"
    mine = nn.Sequential(MyLinear(D, D))  # its ops go through the mode, inside its forward
    assert split_modules(mine) is False and type(mine[0]) is MyLinear
    bare = nn.Module()
    bare.lin, bare.scale = nn.Linear(D, D), nn.Parameter(torch.ones(D))
    assert split_modules(bare) is True
    bare.scale.requires_grad_(False)  # a frozen one needs no gradient: nothing to reach
    assert split_modules(bare) is False


def test_a_swapped_module_is_its_type_outside_split_functions_and_splits_inside():
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    ref = copy.deepcopy(lin)
    split_modules(nn.Sequential(lin))
    assert list(lin.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, D)
    assert torch.equal(lin(x), ref(x))
    queue = WeightGradQueue()
    with SplitFunctions(queue, intercept=False) as split:
        out = lin(x.requires_grad_())
    assert split.deferred == {id(lin.weight), id(lin.bias)}
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    assert lin.weight.grad is None and len(queue) == 1  # the weight's gradient waits for W
    queue.run()
    ref(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("weight_split", ["functions", "autograd"])
def test_reused_weights_are_exact_through_the_modules(weight_split):
    torch.manual_seed(0)
    module = Reused().double()
    ref = copy.deepcopy(module)
    w = StageWorker(module, 1, 3, 2, None, split=True, weight_split=weight_split)
    assert not w._intercept  # every parameter sits in a module: no torch-function mode
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) for _ in range(2)]
    gs = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) for _ in range(2)]
    for mb in range(2):
        w.forward(mb, xs[mb])
    got = [w.backward(mb, gs[mb]) for mb in range(2)]
    for mb in range(2):
        w.weight(mb)
    for mb in range(2):
        x = xs[mb].clone().requires_grad_()
        (ref(x) * gs[mb]).sum().backward()
        torch.testing.assert_close(got[mb], x.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


class BareNorm(nn.Module):
    """HF Llama's RMSNorm as it is written: the weight applied with a bare product."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x


class WithBareNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b = BareNorm(), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.b(torch.tanh(self.a(self.norm(x))))


def test_only_the_forward_of_a_module_with_a_bare_parameter_runs_under_the_mode(monkeypatch):
    seen = ops_through_the_mode(monkeypatch)
    torch.manual_seed(0)
    module = WithBareNorm().double()
    ref = copy.deepcopy(module)
    w = StageWorker(module, 1, 3, 1, None, split=True, weight_split="functions")
    assert not w._intercept
    x = torch.randn(2, 3, D, dtype=torch.float64)
    g = torch.randn(2, 3, D, dtype=torch.float64)
    w.forward(0, x)
    assert seen and F.linear not in seen and torch.tanh not in seen, seen  # the norm's ops only
    assert id(module.norm.weight) in w._functions  # its product was split
    assert torch._C._is_torch_function_mode_enabled() is False  # the mode is off again
    got = w.backward(0, g)
    assert module.norm.weight.grad is None  # its gradient waits for W
    w.weight(0)
    xr = x.clone().requires_grad_()
    (ref(xr) * g).sum().backward()
    torch.testing.assert_close(got, xr.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_the_mode_is_off_again_when_the_module_with_a_bare_parameter_raises():
    module = WithBareNorm()
    split_modules(module)
    with SplitFunctions(WeightGradQueue(), intercept=False):
        with pytest.raises(RuntimeError):
            module.norm(torch.randn(2, D + 1))  # the product's shapes do not fit
        assert not torch._C._is_torch_function_mode_enabled()
        module(torch.randn(2, D))  # and the next forward runs as before
        assert not torch._C._is_torch_function_mode_enabled()
