"""The split backward equals plain autograd on generated stage graphs.

hypothesis writes small stage modules from a vocabulary of ops (linear, layer
norm, conv, attention, embedding, GRU and a GRU cell loop, residuals, layers
and parameters used twice, parameter-only values, outputs derived from other
outputs, outputs that need no gradient, None outputs, several inputs and
outputs) and places them first, in the middle or last. B then W must give
every gradient ``torch.autograd.backward`` gives on a copy, and B must leave
every parameter that W owns untouched.

The mutation check swaps in the capture logic before issue 15
(tests/fixtures/weight_split_before_15.py) and requires the same search to
find a wrong gradient.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
from harness import ROOT
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from torch import nn

from rrfp.pipeline import worker as worker_module
from rrfp.pipeline.split_backward import weight_split
from rrfp.pipeline.worker import StageWorker

B, T, D, V = 2, 3, 4, 7
FLOAT, IDS, NONE = "float", "ids", "none"
MADE = (
    "linear",
    "norm",
    "conv",
    "attn",
    "embed",
    "gru",
    "cell",
    "scale",
    "shift",
    "const",
)  # ops owning a layer
REUSABLE = ("linear", "norm", "conv", "scale", "shift")
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _layer(kind: str) -> nn.Module | None:
    if kind == "linear":
        return nn.Linear(D, D)
    if kind == "norm":
        return nn.LayerNorm(D)
    if kind == "conv":
        return nn.Conv1d(D, D, 3, padding=1)
    if kind == "attn":
        return nn.MultiheadAttention(D, 2, batch_first=True)
    if kind == "embed":
        return nn.Embedding(V, D)
    if kind == "gru":
        return nn.GRU(D, D, batch_first=True)
    if kind == "cell":
        return nn.GRUCell(D, D)
    if kind in ("scale", "shift", "const"):
        return _Vector()
    return None


class _Vector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(D))


class Generated(nn.Module):
    """A stage written as a program: each op reads earlier values, appends one, may own a layer."""

    def __init__(self, inputs: tuple, ops: tuple, outputs: tuple) -> None:
        super().__init__()
        self.inputs, self.ops, self.outputs = inputs, ops, outputs
        self.layers = nn.ModuleList(
            m for kind, _, layer in ops if layer is None and (m := _layer(kind)) is not None
        )

    def forward(self, *xs):
        if len(xs) == 1 and isinstance(xs[0], tuple):
            xs = xs[0]
        pool, own = list(xs), iter(self.layers)
        ids = next((x for x, k in zip(xs, self.inputs) if k == IDS), None)
        made = []
        for kind, (a, b), reuse in self.ops:
            layer = made[reuse] if reuse is not None else (next(own) if kind in MADE else None)
            if reuse is None and kind in MADE:
                made.append(layer)
            pool.append(self._op(kind, layer, pool[a], pool[b], ids))
        out = tuple(None if i is None else pool[i] for i in self.outputs)
        return out[0] if len(out) == 1 else out

    @staticmethod
    def _op(kind, layer, x, y, ids):
        if kind == "linear" or kind == "norm":
            return layer(x)
        if kind == "conv":
            return layer(x.transpose(1, 2)).transpose(1, 2)
        if kind == "attn":
            return layer(x, y, y, need_weights=False)[0]
        if kind == "embed":
            return layer(ids) + x
        if kind == "gru":
            return layer(x)[0]
        if kind == "cell":
            h, hs = torch.zeros(x.shape[0], D, dtype=x.dtype), []
            for t in range(x.shape[1]):
                h = layer(x[:, t], h)
                hs.append(h)
            return torch.stack(hs, 1)
        if kind == "scale":
            return x * layer.p
        if kind == "shift":
            return x + layer.p
        if kind == "const":  # a value of parameters only: it never reaches an input
            return layer.p.expand(B, T, D) * 2
        if kind == "add":
            return x + y
        if kind == "tanh":
            return torch.tanh(x)
        if kind == "detach":
            return x.detach()
        raise AssertionError(kind)


@st.composite
def stages(draw):
    inputs = [FLOAT] + draw(st.lists(st.sampled_from([FLOAT, IDS, NONE]), max_size=2))
    inputs = tuple(draw(st.permutations(inputs)))
    floats = [i for i, k in enumerate(inputs) if k == FLOAT]
    ops, made = [], []  # made: kinds of the layers created so far, by creation order
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(
            st.sampled_from(
                [
                    "linear",
                    "norm",
                    "conv",
                    "attn",
                    "embed",
                    "gru",
                    "cell",
                    "scale",
                    "shift",
                    "const",
                    "add",
                    "tanh",
                    "detach",
                    "reuse",
                ]
            )
        )
        if kind == "embed" and IDS not in inputs:
            kind = "linear"
        a, b = draw(st.sampled_from(floats)), draw(st.sampled_from(floats))
        reuse = None
        if kind == "reuse":
            reusable = [j for j, k in enumerate(made) if k in REUSABLE]
            if not reusable:
                kind = "tanh"
            else:
                reuse = draw(st.sampled_from(reusable))
                kind = made[reuse]
        elif kind in MADE:
            made.append(kind)
        ops.append((kind, (a, b), reuse))
        floats.append(len(inputs) + len(ops) - 1)
    n = len(inputs) + len(ops)
    outputs = draw(
        st.lists(
            st.one_of(st.integers(len(inputs), n - 1), st.integers(0, n - 1), st.none()),
            min_size=1,
            max_size=4,
        )
    )
    if all(
        o is None or o < len(inputs) and inputs[o] == NONE for o in outputs
    ):  # a stage sends something
        outputs = [n - 1] + outputs[1:]
    return tuple(inputs), tuple(ops), tuple(outputs)


def _inputs(kinds, gen):
    return tuple(
        torch.randn(B, T, D, generator=gen, dtype=torch.float64)
        if k == FLOAT
        else torch.randint(0, V, (B, T), generator=gen)
        if k == IDS
        else None
        for k in kinds
    )


def _carries(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()


def _loss(out, targets):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * targets[: o.shape[-1]]).sum() for o in outs if _carries(o))


def check_split(
    program, position: int, seed: int, weight_split: str = "autograd", whole: bool = False
) -> bool:
    """Split B/W of ``program`` at ``position`` (0 first, 1 middle, 2 last) against plain autograd,
    the split made by ``weight_split`` (``whole``: a stage a split schedule leaves unsplit, every
    gradient final after B). Returns whether B kept some parameter's gradient."""
    torch.manual_seed(seed)
    module = Generated(*program).double()
    ref = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(seed)
    xs = _inputs(program[0], gen)
    targets = torch.randn(D, generator=gen, dtype=torch.float64)
    leaves = tuple(
        x.clone().requires_grad_(position > 0) if x is not None and x.is_floating_point() else x
        for x in xs
    )
    out = ref(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    grads = tuple(
        torch.randn(o.shape, generator=gen, dtype=torch.float64) if _carries(o) else None
        for o in outs
    )
    if position == 2:
        loss = _loss(out, targets)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return False  # nothing to differentiate on a last stage
        loss.backward()
    elif any(g is not None for g in grads):
        torch.autograd.backward(
            [o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None]
        )

    w = StageWorker(
        module, position, 3, 1, _loss, split=True, weight_split=weight_split, whole=whole
    )
    x = xs if len(xs) > 1 else xs[0]
    w.forward(0, x, targets if position == 2 else None)
    work = w._slots[0].weights
    in_b = {id(p) for p in work.in_b}
    grad_in = w.backward(
        0, None if position == 2 else (grads if isinstance(out, tuple) else grads[0])
    )
    for name, p in module.named_parameters():
        assert whole or id(p) in in_b or p.grad is None, (
            f"B computed {name}'s gradient, which W owns"
        )
    after_b = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    w.weight(0)
    if whole:
        for (name, p), g in zip(module.named_parameters(), after_b):
            assert (p.grad is None and g is None) or torch.equal(p.grad, g), f"W changed {name}"
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(
            got, want, rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"parameter {name}: {m}"
        )
    if position > 0:
        got_in = grad_in if isinstance(grad_in, tuple) else (grad_in,)
        for i, (leaf, g) in enumerate(zip(leaves, got_in)):
            want = leaf.grad if _carries(leaf) else None
            if want is None:
                assert g is None or not g.abs().any(), (
                    f"input {i}: got a gradient where autograd has none"
                )
            else:
                torch.testing.assert_close(
                    g if g is not None else torch.zeros_like(want),
                    want,
                    rtol=1e-6,
                    atol=1e-9,
                    msg=lambda m, i=i: f"input {i}: {m}",
                )
    return bool(in_b)


@pytest.mark.parametrize("weight_split", ["autograd", "functions"])
@SETTINGS
@given(program=stages(), position=st.sampled_from([1, 2, 0]), seed=st.integers(0, 2**16))
def test_split_gradients_equal_autograd_on_generated_stages(weight_split, program, position, seed):
    """The generic split, and the split-aware functions with the generic split as their fallback
    (their linear, norm, embedding and scale ops queue W themselves)."""
    kept = check_split(program, position, seed, weight_split)
    event(
        f"{('first', 'middle', 'last')[position]} stage, {'some' if kept else 'no'} parameters in B"
    )


@settings(SETTINGS, max_examples=60)
@given(program=stages(), position=st.sampled_from([1, 2, 0]), seed=st.integers(0, 2**16))
def test_a_stage_left_unsplit_equals_autograd_on_generated_stages(program, position, seed):
    """schedule.unsplit_stages: B runs the stage's whole backward, W adds nothing."""
    check_split(program, position, seed, "functions", whole=True)


def _before_15():
    path = ROOT / "tests" / "fixtures" / "weight_split_before_15.py"
    spec = importlib.util.spec_from_file_location("weight_split_before_15", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    analyse = module.plan  # the fixture's name for weight_split.analyse

    def analyse_with_reasons(*args, **kwargs):  # the worker now reads why a parameter stays in B
        result = analyse(*args, **kwargs)
        result.reasons = {id(p): "used more than once" for p in result.in_b}
        result.whole = None  # and whether the whole backward stays in B (a reentrant checkpoint)
        return result

    module.analyse = analyse_with_reasons
    return module


def test_mutation_the_capture_logic_before_issue_15_fails(monkeypatch):
    """The same search, with the old capture logic, finds a wrong weight gradient. Found is
    what it asserts, so hypothesis stops there instead of shrinking the example."""
    monkeypatch.setattr(worker_module, "weight_split", _before_15())

    @settings(SETTINGS, phases=[Phase.explicit, Phase.generate])
    @given(program=stages(), position=st.sampled_from([1, 2, 0]), seed=st.integers(0, 2**16))
    def search(program, position, seed):
        check_split(program, position, seed)

    with pytest.raises(AssertionError, match="parameter"):
        search()


@pytest.mark.parametrize(
    "make",
    [
        lambda: (nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.LayerNorm(D)), nn.Linear(D, 3)),
    ],
    ids=["layer-norm-then-side-output"],
)
def test_the_reported_derived_output_is_exact(make):
    """Issue 15's case: h2 = LayerNorm(relu(Linear(x))) and side = Linear2(h2), both sent on."""
    program = (
        (FLOAT,),
        (
            ("linear", (0, 0), None),
            ("tanh", (1, 1), None),
            ("norm", (2, 2), None),
            ("linear", (3, 3), None),
        ),
        (3, 4),
    )
    for position in (0, 1, 2):
        check_split(program, position, seed=3)
    assert weight_split.RERUN_LIMIT > 0
