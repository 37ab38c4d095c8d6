"""What every rank adds into a training step's one all-reduce: its part of the loss, time, tokens
and gradient norm, whether it saw a NaN/Inf, a stop request, or abandoned the step, so that every
rank steps, skips or stops alike, and, in its own slot, its measured peak memory and microbatches
in flight (the other ranks add 0 there), so rank 0 learns every rank's without a collective of its
own. Named fields, sent as one float64 tensor."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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
    grad_sq: float = 0.0  # the sum of squared gradients each rank counts (the norm's square)
    moe_layers: float = 0.0  # MoE layers the ranks hold (0: no router statistics)
    aux_loss: float = 0.0  # their weighted auxiliary losses (summed over TP and DP ranks)
    dropped: float = 0.0  # token copies they routed but did not compute
    # per rank (world-size slots, each rank filling its own): the peak bytes its memory measure saw
    memory: list[float] = field(default_factory=list)
    in_flight: list[float] = field(default_factory=list)  # ... and its most microbatches held
    # ... and its MoE layers' worst most-loaded expert over the mean load
    expert_load: list[float] = field(default_factory=list)

    @classmethod
    def of_rank(cls, rank: int, world: int, memory: float, in_flight: float, **scalars):
        """A rank's statistics, with its own memory and in-flight slots filled in."""
        mine = cls(**scalars, **{name: [0.0] * world for name in PER_RANK})
        mine.memory[rank], mine.in_flight[rank] = memory, in_flight
        return mine

    def to_tensor(self) -> torch.Tensor:
        scalars = [getattr(self, f.name) for f in fields(self) if f.name not in PER_RANK]
        slots = [v for name in PER_RANK for v in getattr(self, name)]
        return torch.tensor([*scalars, *slots], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, world: int = 0) -> StepStatistics:
        values = t.tolist()
        n = len(fields(cls)) - len(PER_RANK)
        if len(values) != n + len(PER_RANK) * world:
            raise ValueError(
                f"{len(values)} statistics, expected {n + len(PER_RANK) * world} ({world} ranks)"
            )
        rest = values[n:]
        slots = {name: rest[i * world : (i + 1) * world] for i, name in enumerate(PER_RANK)}
        return cls(*values[:n], **slots)


PER_RANK = (
    "memory",
    "in_flight",
    "expert_load",
)  # the fields with a slot per rank, sent after the scalars
