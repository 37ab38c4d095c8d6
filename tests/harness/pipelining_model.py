"""The small token model the ScheduleReady tests pipeline (tests/pipelining/): its stages, a
batch, the loss, and how far two sets of gradients are apart."""

from __future__ import annotations

import torch
from torch import nn

M = 4
VOCAB, DIM, BATCH = 11, 8, 2


def full_model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Chunk(s == 0, s == stages - 1) for s in range(stages)])


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(seed: int, length: int, rows: int = BATCH * M):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, length), generator=g), torch.randint(
        0, VOCAB, (rows, length), generator=g
    )


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def grads_of(module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


class Chunk(nn.Module):
    """One stage of a small token model: embedding on the first, projection to the vocabulary on the
    last. The first stage also takes a keyword argument (a scale), as torch lets a first stage."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, h, scale: float = 1.0):
        if self.embed is not None:
            h = self.embed(h) * scale
        h = torch.tanh(self.body(h))
        return self.head(h) if self.head is not None else h
