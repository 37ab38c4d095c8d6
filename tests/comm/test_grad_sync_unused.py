"""Under DP, a parameter unused on every replica keeps grad = None after the
gradient sync (so AdamW leaves it alone, as without DP); one used on some
replicas only is averaged with zeros from the others."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _sync(rank, world):
    import asyncio

    import torch
    from torch import nn

    from rrfp.pipeline.runtime import PipelineRuntime

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.sometimes, self.unused = (
                nn.Linear(3, 1),
                nn.Linear(3, 1),
                nn.Linear(3, 1),
            )

        def forward(self, x, replica):
            y = self.used(x)
            return (
                y + self.sometimes(x) if replica == 0 else y
            )  # replica 1 never touches `sometimes`

    async def main():
        async with PipelineRuntime.start(pp=1, dp=world, timeout_s=30) as rt:
            torch.manual_seed(0)
            net = Net()
            start = {n: p.detach().clone() for n, p in net.named_parameters()}
            sync = rt.grad_sync(net)
            opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
            x = torch.full((2, 3), float(rank + 1))
            grads = {}
            for _ in range(3):
                net(x, rank).sum().backward()
                local = {
                    n: None if p.grad is None else p.grad.tolist()
                    for n, p in net.named_parameters()
                }
                await sync.sync()
                # plain lists: tensors would travel back through shared memory, gone with the
                # process
                grads = {
                    n: (None if p.grad is None else p.grad.tolist(), local[n])
                    for n, p in net.named_parameters()
                }
                opt.step()
                opt.zero_grad(set_to_none=True)
            moved = {n: not torch.equal(p, start[n]) for n, p in net.named_parameters()}
        return grads, moved

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_unused_parameters_keep_no_gradient_under_dp():
    results = run_ranks(_sync, 2, timeout=75)
    for rank, (grads, moved) in results.items():
        assert grads["unused.weight"] == (None, None) and grads["unused.bias"] == (None, None)
        assert not moved["unused.weight"] and not moved["unused.bias"], (
            f"rank {rank}: AdamW moved {moved}"
        )
        assert moved["used.weight"] and moved["sometimes.weight"]
        for name in ("sometimes.weight", "sometimes.bias"):
            synced, _ = grads[name]
            assert synced is not None, (
                f"rank {rank}: {name} is used on replica 0, so it has a gradient"
            )
            # replica 0's gradient averaged with replica 1's zeros
            assert close(synced, t(results[0][0][name][1]) / 2)
        mean = (t(results[0][0]["used.weight"][1]) + t(results[1][0]["used.weight"][1])) / 2
        assert close(grads["used.weight"][0], mean)


def t(values):
    import torch

    return torch.tensor(values)


def close(a, b) -> bool:
    import torch

    return torch.allclose(t(a), b, rtol=0, atol=1e-6)
