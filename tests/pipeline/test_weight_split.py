"""B/W split for plain torch modules, with autograd on the stage's own graph."""

from __future__ import annotations

import logging

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rrfp.pipeline.split_backward import weight_split
from rrfp.pipeline.worker import StageWorker


class ConvBlock(nn.Module):
    """Conv2d, LayerNorm, Linear: none of them split-aware."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).permute(0, 2, 3, 1)  # [b, h, w, c]
        return self.proj(torch.nn.functional.gelu(self.norm(h))) + h


def mlp(width: int = 256, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            m
            for _ in range(depth)
            for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
        ]
    )


@pytest.mark.parametrize("make,shape", [(ConvBlock, (2, 3, 6, 6)), (mlp, (16, 256))])
def test_middle_stage_split_matches_autograd(make, shape):
    torch.manual_seed(1)
    module = make()
    x = torch.randn(*shape, dtype=torch.float64)
    module = module.double()
    ref = make().double()
    ref.load_state_dict(module.state_dict())
    xr = x.clone().requires_grad_(True)
    out = ref(xr)
    g = torch.randn_like(out)
    out.backward(g)

    w = StageWorker(module, 1, 3, 1, None, split=True)
    w.forward(0, x)
    grad_in = w.backward(0, g)
    assert torch.allclose(grad_in, xr.grad, atol=1e-12)
    assert all(p.grad is None for p in module.parameters()), "B computed a weight gradient"
    w.weight(0)
    for (name, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-12), name


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_w_does_the_weight_work_once():
    """Counted in FLOPs, not seconds: W carries about half of the backward, and B + W
    is exactly the unsplit backward, so nothing is computed twice."""
    x, g = torch.randn(64, 256), torch.randn(64, 256)
    split = StageWorker(mlp(), 1, 3, 1, None, split=True)
    split.forward(0, x)
    b = flops(lambda: split.backward(0, g))
    w = flops(lambda: split.weight(0))
    whole = StageWorker(mlp(), 1, 3, 1, None, split=False)
    whole.forward(0, x)
    full = flops(lambda: whole.backward(0, g))
    assert b + w == full, (b, w, full)
    assert 0.4 < w / full < 0.6, w / full


def test_first_stage_b_is_free_and_w_is_the_backward():
    x, g = torch.randn(64, 256), torch.randn(64, 256)
    w = StageWorker(mlp(), 0, 3, 1, None, split=True)
    w.forward(0, x)
    assert flops(lambda: w.backward(0, g)) == 0 and all(
        p.grad is None for p in w.module.parameters()
    )
    w.weight(0)
    assert all(p.grad is not None for p in w.module.parameters())


def test_a_weight_used_twice_is_gathered_in_w_and_its_bias_named_once(caplog):
    """The weight reaches W through one transpose per use, so W gathers every use. The bias
    goes straight into its accumulator from both uses, the outer one above the inner: B
    computes it, and the module says so once, with that reason."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)

        def forward(self, x):
            return self.shared(torch.tanh(self.shared(x)))

    torch.manual_seed(0)
    module = Twice().double()
    ref = Twice().double()
    ref.load_state_dict(module.state_dict())
    x, g = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    ref(x.clone().requires_grad_(True)).backward(g)
    caplog.set_level(logging.WARNING, logger="rrfp.pipeline.split_backward.weight_split")
    weight_split._warned.clear()
    w = StageWorker(module, 1, 3, 2, None, split=True)
    for mb in (0, 1):
        w.forward(mb, x)
        w.backward(mb, g / 2)
        if mb == 0:
            assert module.shared.weight.grad is None, "B computed the shared weight's gradient"
        w.weight(mb)
    assert torch.allclose(module.shared.weight.grad, ref.shared.weight.grad, atol=1e-12)
    assert torch.allclose(module.shared.bias.grad, ref.shared.bias.grad, atol=1e-12)
    lines = [r.getMessage() for r in caplog.records if "in B, not W" in r.getMessage()]
    assert len(lines) == 1 and "shared.bias" in lines[0] and "shared.weight" not in lines[0], lines
    assert "accumulator" in lines[0] and "used 2 times" not in lines[0], lines


def _plain_pipeline(rank, world, configs):
    """A plain-torch model, one nn.Sequential chunk per stage, under real gloo ranks."""
    import asyncio

    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    full = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh()) for _ in range(world)]
    )
    loss_fn = nn.functional.mse_loss
    gen = torch.Generator().manual_seed(2)
    data = [
        (torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)) for _ in range(4)
    ]
    sum(loss_fn(full(x), y) for x, y in data).div(len(data)).backward()
    ref = {n: p.grad.clone() for n, p in full[rank].named_parameters()}

    async def main():
        out = {}
        async with PipelineRuntime.start(pp=world, timeout_s=60) as rt:
            for dispatch, hint in configs:
                torch.manual_seed(0)
                chunk = nn.Sequential(
                    *[
                        nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh())
                        for _ in range(world)
                    ]
                )[rank]
                ex = rt.stage_executor(
                    chunk, loss_fn, n_microbatches=4, dispatch=dispatch, hint=hint
                )
                res = await ex.run_iteration(0, data)
                out[(dispatch, hint)] = (
                    max((p.grad - ref[n]).abs().max().item() for n, p in chunk.named_parameters()),
                    [str(t) for t in res.order],
                )
        return out

    return asyncio.run(main())


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_plain_model_under_bfw_matches_reference():
    configs = [("ready", "bfw"), ("fixed", "bfw"), ("ready", "1f1b")]
    results = run_ranks(_plain_pipeline, 2, configs, timeout=100)
    for rank, out in results.items():
        for cfg, (err, order) in out.items():
            assert err < 1e-12, (rank, cfg, err)
            if cfg[1] == "bfw":
                assert sum(t.startswith("W") for t in order) == 4, order


def test_split_linear_queue_and_autograd_split_agree():
    """weight_split='layers' (SplitLinear's queue, autograd elsewhere) gives autograd's split."""
    from rrfp.models.gpt import GPT, GPTConfig, make_stage

    torch.manual_seed(0)
    full = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=16)).double()
    x, g = torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    grads = {}
    for mode in ("layers", "autograd"):
        stage = make_stage(full, 1, 3)
        w = StageWorker(stage, 1, 3, 1, None, split=True, weight_split=mode)
        w.forward(0, x)
        gin = w.backward(0, g)
        w.weight(0)
        grads[mode] = (gin, {n: p.grad for n, p in stage.named_parameters()})
    assert torch.allclose(grads["layers"][0], grads["autograd"][0], atol=1e-12)
    for n, v in grads["layers"][1].items():
        assert v is not None and torch.allclose(v, grads["autograd"][1][n], atol=1e-12), n
