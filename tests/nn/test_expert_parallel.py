"""Expert parallelism on real gloo ranks: a MoE layer whose experts are sharded over an EP group
of 2 gives each member the outputs, input gradients and router gradients of the whole layer run on
its own tokens (the auxiliary loss's gradient included), and each expert's gradient summed over
both members' tokens."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _layer(rank, world, num_experts, top_k, tokens):
    import torch
    import torch.distributed as dist

    from rrfp.nn.expert_parallel import ExpertParallel, expert_parameters, shard_experts
    from rrfp.nn.moe_layer import MoELayer

    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    full = MoELayer(16, 24, num_experts, top_k, aux_loss_coeff=0.01)  # its gradient injected
    xs = [torch.randn(tokens[r], 16) for r in range(world)]
    # the reference: the whole layer on each member's tokens apart
    ref = []
    for x in xs:
        x = x.clone().requires_grad_()
        out = full(x)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in full.named_parameters()}
        ref.append((out.detach(), x.grad, grads))
        full.zero_grad()

    ep = shard_experts(full, dist.group.WORLD)
    assert isinstance(full.experts, ExpertParallel) and ep == 1
    shards = expert_parameters(full)
    x = xs[rank].clone().requires_grad_()
    out = full(x)
    out.square().sum().backward()
    want_out, want_x, want = ref[rank]
    err = {
        "out": (out - want_out).abs().max().item(),
        "x.grad": (x.grad - want_x).abs().max().item(),
    }
    k = num_experts // world
    for n, p in full.named_parameters():
        if id(p) in shards:  # each expert's gradient: every member's tokens that reached it
            expect = sum(r[2][n] for r in ref)[rank * k : (rank + 1) * k]
        else:  # a replicated parameter's: this member's tokens alone
            expect = want[n]
        err[n] = (p.grad - expect).abs().max().item()
    names = sorted(n for n, p in full.named_parameters() if id(p) in shards)
    dist.destroy_process_group()
    return err, names


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tokens", [(12, 12), (5, 17), (1, 9)])
def test_sharded_experts_equal_the_whole_layer(tokens):
    """Uneven token counts per member (so uneven splits), top-2 over 4 experts."""
    results = run_ranks(_layer, 2, 4, 2, tokens, timeout=150)
    for rank, (err, names) in results.items():
        assert names == ["experts.w1", "experts.w2", "experts.w3"]
        assert max(err.values()) < 1e-12, (rank, err)
