"""The model of the virtual-stage tests on real gloo ranks (tests/pipeline/): pieces whose
boundaries carry several tensors, built for any number of stages."""

from __future__ import annotations

import torch
from torch import nn

D = 6  # the width of every piece


def build(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Piece(s == 0, s == num_stages - 1) for s in range(num_stages)]).double()


class Piece(nn.Module):
    """One stage: a LayerNorm'd MLP step that also sends a derived tensor and an int mask on,
    so a stage boundary carries several tensors (and the V turn hands them over as a tuple)."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.lin, self.norm = nn.Linear(D, D), nn.LayerNorm(D)
        self.out = nn.Linear(D, 2 if last else D)  # the head, or the derived tensor sent beside h

    def forward(self, inputs):
        if self.first:
            h, side, mask = inputs, torch.zeros_like(inputs), (inputs[..., 0] > 0).long()
        else:
            h, side, mask = inputs
        h = self.norm(torch.tanh(self.lin(h + side)) * (1 + mask.unsqueeze(-1)))
        if self.last:
            return self.out(h)
        return h, self.out(h), mask
