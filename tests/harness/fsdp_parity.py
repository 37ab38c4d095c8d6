"""The model, data and one-process reference that the FSDP2 parity tests share: two stages of a
float64 MLP (two stages, or four), a whole batch per step split between two replicas, AdamW."""

from __future__ import annotations

M, STEPS, ROWS, D = 4, 2, 16, 4  # ROWS: one step's whole batch, both replicas' together
LR = 0.05


def model(stages: int = 2):
    """``stages`` stages of unequal units (their all-gathers differ in size, so a mispairing
    fails)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(D, 5 + s), nn.Tanh(), nn.Linear(5 + s, D))
            for s in reversed(range(stages))
        )
    ).double()


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, D, generator=g, dtype=torch.float64)
    return x, torch.randn(ROWS, D, generator=g, dtype=torch.float64)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def shard(stage_module, mesh):
    """fully_shard each Linear, then the stage, over the stage's replicas."""
    import torch
    from torch.distributed.fsdp import fully_shard

    for sub in stage_module:
        if isinstance(sub, torch.nn.Linear):
            fully_shard(sub, mesh=mesh)
    return fully_shard(stage_module, mesh=mesh)


def full(t):
    """The whole tensor as nested lists (what a rank sends back): a DTensor gathered."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).tolist()


def reference(stages: int = 2):
    """One process, the whole batch: (last step's gradients, parameters after STEPS steps,
    every step's microbatch losses in replica order)."""
    import torch

    ref = model(stages)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        per = [loss_fn(ref(a), b) for a, b in zip(x.chunk(2 * M), y.chunk(2 * M))]
        (sum(per) / len(per)).backward()
        losses.append([p.item() for p in per])
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
    return grads, {n: p.detach().clone() for n, p in ref.named_parameters()}, losses
