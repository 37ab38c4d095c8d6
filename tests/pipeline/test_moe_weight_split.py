"""A mixture-of-experts stage under the split backward (StageWorker, every weight-split mode):
B leaves the routed experts' and the router's weight gradients to W, and after W every gradient,
the auxiliary loss's share included, equals plain autograd's (float64)."""

import copy

import pytest
import torch

from rrfp import StageWorker
from rrfp.models.llama import Llama, LlamaConfig
from rrfp.nn.moe_aux_loss import aux_loss_scale

M = 3
CFG = LlamaConfig(
    n_layer=3,
    n_embd=16,
    n_head=2,
    n_kv_head=1,
    intermediate_size=24,
    moe_experts=4,
    moe_intermediate_size=12,
    moe_shared_intermediate_size=8,
    moe_aux_loss_coeff=0.1,
)


@pytest.mark.parametrize("weight_split", ["autograd", "layers", "functions"])
def test_expert_weight_grads_belong_to_w(weight_split):
    torch.manual_seed(0)
    stage = Llama(CFG, 1, 3).double()  # a middle stage: hidden in, hidden out, one MoE block
    ref = copy.deepcopy(stage)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
    gs = [torch.randn(2, 5, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
    w = StageWorker(stage, 1, 3, M, None, split=True, weight_split=weight_split)
    routed = {n for n, _ in stage.named_parameters() if ".experts." in n or "router" in n}
    assert len(routed) == 4
    for mb in range(M):
        w.forward(mb, xs[mb])
    got = [w.backward(mb, gs[mb]) for mb in range(M)]
    after_b = {n for n, p in stage.named_parameters() if p.grad is not None}
    assert not after_b & routed, sorted(after_b & routed)
    for mb in range(M):
        w.weight(mb)
    for mb in range(M):
        x = xs[mb].clone().requires_grad_()
        with aux_loss_scale(1 / M):  # as the worker's forward: the loss of a microbatch over M
            out = ref(x)
        (out * gs[mb]).sum().backward()
        torch.testing.assert_close(got[mb], x.grad, rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(stage.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
