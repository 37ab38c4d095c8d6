"""A small float64 MLP, each DP replica's microbatches, and the single-process reference
gradients, shared by the DP gradient-sync tests (torch imported inside: the ranks import it)."""

from __future__ import annotations

M = 2  # microbatches per replica and iteration


def model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def data(replica: int, iteration: int = 0):
    import torch

    g = torch.Generator().manual_seed(10 + replica + 100 * iteration)
    return [
        (
            torch.randn(2, 4, generator=g, dtype=torch.float64),
            torch.randn(2, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(M)
    ]


def reference(world: int, iterations: int = 1) -> dict[str, list]:
    """Each iteration's mean loss over all replicas' microbatches, the gradients summed over
    iterations, as plain lists."""
    from torch import nn

    ref = model()
    for it in range(iterations):
        batches = [b for r in range(world) for b in data(r, it)]
        (sum(nn.functional.mse_loss(ref(x), y) for x, y in batches) / len(batches)).backward()
    return {n: p.grad.tolist() for n, p in ref.named_parameters()}
