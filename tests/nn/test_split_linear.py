import contextlib
import threading

import pytest
import torch
import torch.nn as nn

from rrfp.nn.split_linear import SplitLinear, WeightGradQueue, accumulate_grad, collect_weight_grads


def _pair(bias=True, in_f=5, out_f=7):
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=torch.float64)
    torch.manual_seed(0)
    lin = SplitLinear(in_f, out_f, bias=bias, dtype=torch.float64)
    return ref, lin


def _grads(m):
    return [p.grad for p in m.parameters()]


def test_same_init_as_nn_linear():
    ref, lin = _pair()
    assert torch.equal(ref.weight, lin.weight) and torch.equal(ref.bias, lin.bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 5), (2, 3, 2, 5)])
def test_immediate_matches_nn_linear(bias, shape):
    ref, lin = _pair(bias)
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 7, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ys = ref(xr), lin(xs)
    assert torch.equal(yr, ys)
    yr.backward(g)
    ys.backward(g)
    assert torch.equal(xr.grad, xs.grad)
    for a, b in zip(_grads(ref), _grads(lin)):
        assert torch.equal(a, b)


def _hooked():
    """Saved-tensor hooks that keep what they are given, as a non-reentrant checkpoint's are
    active during its region: the split linear keeps its input through them."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


# the saved-tensor hooks each row runs under
FORMS = {"no saved-tensor hooks": contextlib.nullcontext, "saved-tensor hooks": _hooked}
# the form taken under either, by whether the input wants a gradient: with one, a hook on the
# product's native node queues W ("hook"); without, the two-node form's product node
NODE = {True: "hook", False: "_SplitLinearFnBackward"}


def _product_node(y):
    """The split linear's product node, or "hook" where it is native and the weight is not in the
    graph (the node carries the hook)."""
    node = y.grad_fn
    while node.name() == "ViewBackward0":
        node = node.next_functions[0][0]
    if node.name().startswith("_"):
        return node.name()
    seen, stack = set(), [y.grad_fn]
    while stack:  # no edge to the weight anywhere below
        n = stack.pop()
        if n is not None and n not in seen:
            seen.add(n)
            assert n.name() != "AccumulateGrad" or n.variable.ndim != 2, n.name()
            stack.extend(c for c, _ in n.next_functions)
    return "hook"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_deferred_matches_nn_linear(bias, x_requires_grad, form):
    hooks, node = FORMS[form], NODE[x_requires_grad]
    ref, lin = _pair(bias)
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    g = torch.randn(2, 3, 7, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(x_requires_grad), x.clone().requires_grad_(x_requires_grad)
    ref(xr).backward(g)
    queue = WeightGradQueue()
    with collect_weight_grads(queue), hooks():
        ys = lin(xs)
    assert _product_node(ys) == node
    ys.backward(g)
    # B is done: input grad is there, weight grads are not
    assert len(queue) == 1
    assert lin.weight.grad is None and (lin.bias is None or lin.bias.grad is None)
    if x_requires_grad:
        torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=1e-13)
    else:
        assert xs.grad is None
    queue.run()
    assert len(queue) == 0
    for a, b in zip(_grads(ref), _grads(lin)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-13)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(5,), (0, 5), (1, 5), (3, 0, 5), (2, 1, 4, 5)])
def test_deferred_matches_nn_linear_on_any_leading_shape(shape, form):
    """One row, no rows and more leading dims: B's input gradient and W's take the input's
    shape, in either form."""
    ref, lin = _pair(bias=True)
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 7, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).backward(g)
    queue = WeightGradQueue()
    with collect_weight_grads(queue), FORMS[form]():
        ys = lin(xs)
    assert ys.shape == (*shape[:-1], 7)
    ys.backward(g)
    queue.run()
    assert xs.grad.shape == x.shape
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=1e-13)
    for a, b in zip(_grads(ref), _grads(lin)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-13)


@pytest.mark.parametrize("form", FORMS)
def test_no_input_gradient_is_computed_for_an_input_that_wants_none(form):
    """The weight alone wants a gradient: backward and W run one matmul, the weight's."""
    _, lin = _pair(bias=False)
    x, g = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 7, dtype=torch.float64)
    queue = WeightGradQueue()
    with collect_weight_grads(queue), FORMS[form]():
        y = lin(x)
    assert _product_node(y) == NODE[False]
    with torch.profiler.profile() as prof:
        y.backward(g)
        queue.run()
    mms = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::matmul")]
    assert [e.name for e in mms] == ["aten::mm"], [e.name for e in mms]
    torch.testing.assert_close(lin.weight.grad, g.reshape(-1, 7).t() @ x.reshape(-1, 5))


def test_accumulates_over_two_microbatches():
    ref, lin = _pair()
    xs = [torch.randn(2, 3 + i, 5, dtype=torch.float64) for i in range(2)]
    queues = [WeightGradQueue(), WeightGradQueue()]
    outs = []
    for x, q in zip(xs, queues):
        with collect_weight_grads(q):
            outs.append(lin(x))
    for x, y in zip(xs, outs):
        ref(x).pow(2).sum().backward()
        y.pow(2).sum().backward()
    assert lin.weight.grad is None
    queues[1].run()  # W out of microbatch order is fine
    after_one = lin.weight.grad.clone()
    queues[0].run()
    assert not torch.allclose(after_one, lin.weight.grad)
    for a, b in zip(_grads(ref), _grads(lin)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_queue_captured_at_forward_not_backward():
    """Backward in another thread and another context still feeds the forward's queue."""
    _, lin = _pair()
    queue, other = WeightGradQueue(), WeightGradQueue()
    with collect_weight_grads(queue):
        y = lin(torch.randn(3, 5, dtype=torch.float64))

    def bwd():
        with collect_weight_grads(other):
            y.sum().backward()

    t = threading.Thread(target=bwd)
    t.start()
    t.join()
    assert len(queue) == 1 and len(other) == 0


def test_no_queue_after_context_exit():
    _, lin = _pair()
    queue = WeightGradQueue()
    with collect_weight_grads(queue):
        pass
    lin(torch.randn(3, 5, dtype=torch.float64)).sum().backward()
    assert len(queue) == 0 and lin.weight.grad is not None


def test_shared_weight_accumulates():
    """Tied weight used by two layers: deferred and immediate grads add up."""
    torch.manual_seed(1)
    a = SplitLinear(4, 4, bias=False, dtype=torch.float64)
    b = SplitLinear(4, 4, bias=False, dtype=torch.float64)
    b.weight = a.weight
    x = torch.randn(2, 4, dtype=torch.float64)
    ref_w = a.weight.detach().clone().requires_grad_()
    (x @ ref_w.t() @ ref_w.t()).sum().backward()
    queue = WeightGradQueue()
    with collect_weight_grads(queue):
        h = a(x)
    b(h).sum().backward()  # b immediate, a deferred
    assert a.weight.grad is not None
    queue.run()
    torch.testing.assert_close(a.weight.grad, ref_w.grad, rtol=0, atol=1e-13)


def test_accumulate_grad_adds():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    accumulate_grad(p, torch.ones(3, dtype=torch.float64))
    accumulate_grad(p, torch.ones(3, dtype=torch.float64))
    assert torch.equal(p.grad, torch.full((3,), 2.0, dtype=torch.float64))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        SplitLinear(0, 3)


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_an_input_changed_in_place_before_backward_is_refused(x_requires_grad):
    """The input W needs, changed in place after the forward, would give a wrong weight gradient:
    B refuses, as autograd refuses a changed saved tensor. (Under saved-tensor hooks that keep the
    tensor itself, autograd checks nothing, for nn.Linear alike.)"""
    _, lin = _pair()
    h = torch.randn(2, 3, 5, dtype=torch.float64).requires_grad_(x_requires_grad) * 1
    queue = WeightGradQueue()
    with collect_weight_grads(queue):
        y = lin(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("form", FORMS)
def test_an_output_changed_in_place_still_gives_the_products_gradient(form):
    ref, lin = _pair()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).relu_().pow(2).sum().backward()
    queue = WeightGradQueue()
    with collect_weight_grads(queue), FORMS[form]():
        y = lin(xs).relu_()  # with a bias, on 3-D rows: a view of the product, changed in place
    y.pow(2).sum().backward()
    queue.run()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=1e-13)
    for a, b in zip(_grads(ref), _grads(lin)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-13)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("frozen", ["weight", "bias", "both"])
def test_a_frozen_parameter_gets_no_gradient_and_queues_nothing_of_its_own(form, frozen):
    ref, lin = _pair()
    for m in (ref, lin):
        for name in ("weight", "bias") if frozen == "both" else (frozen,):
            getattr(m, name).requires_grad_(False)
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    queue = WeightGradQueue()
    with collect_weight_grads(queue), FORMS[form]():
        y = lin(xs)
    y.pow(2).sum().backward()
    assert len(queue) == (0 if frozen == "both" else 1)
    queue.run()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=1e-13)
    for a, b in zip(ref.parameters(), lin.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-13)
