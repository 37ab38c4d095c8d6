"""nn.RMSNorm under the split-aware functions (rrfp/nn/split_rms_norm.py): B gives the input
gradient and leaves the weight's to the queue, and the two equal plain autograd's (float64)."""

import pytest
import torch
from torch import nn

from rrfp.nn.split_functions import SplitFunctions
from rrfp.nn.split_linear import WeightGradQueue


@pytest.mark.parametrize(("shape", "eps"), [((8,), 1e-6), ((4, 8), None)])
def test_rms_norm_weight_grad_is_queued_and_exact(shape, eps):
    torch.manual_seed(0)
    norm = nn.RMSNorm(shape, eps=eps, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, 8, dtype=torch.float64)
    (want_x,) = torch.autograd.grad(norm(x), x, g, retain_graph=True)
    want_w = torch.autograd.grad(norm(x), norm.weight, g)[0]

    queue = WeightGradQueue()
    mode = SplitFunctions(queue)
    with mode:
        out = norm(x)
    assert mode.deferred == {id(norm.weight)}
    assert out.grad_fn.name() == "_RMSNormFnBackward"
    (got_x,) = torch.autograd.grad(out, x, g)
    assert norm.weight.grad is None, "B computed the weight's gradient"
    assert len(queue) == 1
    queue.run()
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.weight.grad, want_w, rtol=1e-12, atol=1e-12)


def test_rms_norm_without_a_weight_stays_with_autograd():
    norm = nn.RMSNorm(8, elementwise_affine=False, dtype=torch.float64)
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    mode = SplitFunctions(WeightGradQueue())
    with mode:
        out = norm(x)
    assert not mode.deferred and out.grad_fn.name() != "_RMSNormFnBackward"
