"""What every rank adds into a training step's one all-reduce: its part of the loss, time and
tokens, and whether it saw a NaN/Inf, a stop request, or abandoned the step, so that every rank
steps, skips or stops alike. Named fields, sent as one float64 tensor."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch


@dataclass
class StepStatistics:
    loss: float = 0.0  # the last stage's mean loss (summed over TP and DP ranks)
    busy: float = 0.0  # seconds this rank's tasks ran
    wall: float = 0.0  # seconds the iteration took on this rank
    tokens: float = 0.0  # tokens the first stage read
    nonfinite: float = 0.0  # ranks that saw a NaN or Inf in a loss or gradient
    stops: float = 0.0  # ranks on which a stop was requested
    abandoned: float = 0.0  # ranks that abandoned the step midway
    attn: float = 0.0  # the first stage's rows' attention term, sum(rows x length^2), for MFU

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepStatistics:
        values = t.tolist()
        if len(values) != len(fields(cls)):
            raise ValueError(f"{len(values)} statistics, expected {len(fields(cls))}")
        return cls(*values)
