"""Task durations from a run's recorded routing (``output.routing``) instead of the moe preset's
draws.

A record has, per step, stage, microbatch and MoE layer, each replica's tokens per expert. The
replicas of a stage are its expert-parallel group's sources, so their counts add up to what each
expert received; experts sit on ``ep`` ranks in contiguous slices (rrfp.nn.expert_parallel), and
a layer's load is its busiest EP rank's tokens over the mean. A task then takes what the moe
preset gives it at that load (rrfp.core.variability: the dense part stays, the experts and, for F
and B, the all-to-all wait for the busiest rank), with the stage's layers averaged, each kind
divided by its mean over the record so that time stays in average tasks. Every recorded step is
one "seed" of the sweep: the same rows run on the step's durations.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability

FIELDS = ("step", "stage", "microbatch", "layer", "tokens")


@dataclass(frozen=True)
class Routing:
    """A routing record, summed over replicas: ``tokens[(step, stage, mb)][layer]`` per expert."""

    tokens: dict[tuple[int, int, int], dict[int, npt.NDArray[np.int64]]]
    steps: list[int]
    stages: int
    microbatches: int
    experts: int
    ep: int  # the recorded run's expert-parallel size

    @classmethod
    def parse(cls, lines: Iterable[str], where: str = "routing record") -> Routing:
        tokens: dict[tuple[int, int, int], dict[int, npt.NDArray[np.int64]]] = {}
        experts = ep = None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (int(row["step"]), int(row["stage"]), int(row["microbatch"]))
                layer, counts = int(row["layer"]), np.asarray(row["tokens"], dtype=np.int64)
                run_ep = int(row.get("ep", 1))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{where} line {n}: not a routing row ({', '.join(FIELDS)}): {e!r}"
                ) from None
            if counts.ndim != 1 or counts.size == 0 or (counts < 0).any() or min(key) < 0:
                raise ValueError(f"{where} line {n}: tokens must be counts per expert, >= 0")
            if experts not in (None, counts.size) or ep not in (None, run_ep):
                raise ValueError(
                    f"{where} line {n}: {counts.size} experts, ep {run_ep}, unlike line 1"
                )
            experts, ep = counts.size, run_ep
            by_layer = tokens.setdefault(key, {})
            by_layer[layer] = by_layer.get(layer, 0) + counts
        if not tokens or experts is None or ep is None:
            raise ValueError(f"{where}: no routing rows (did the model have MoE layers?)")
        steps = sorted({s for s, _, _ in tokens})
        stages = 1 + max(st for _, st, _ in tokens)
        microbatches = 1 + max(m for _, _, m in tokens)
        for step in steps:
            seen = {m for s, _, m in tokens if s == step}
            if len(seen) != microbatches:
                raise ValueError(
                    f"{where}: step {step} has {len(seen)} of {microbatches} microbatches"
                )
        return cls(tokens, steps, stages, microbatches, experts, ep)

    def load(self, step: int, stage: int, mb: int, ep: int) -> float:
        """The busiest EP rank's tokens over the mean, averaged over the stage's MoE layers (1: no
        MoE layer on the stage)."""
        layers = self.tokens.get((step, stage, mb))
        if not layers:
            return 1.0
        ratios = []
        for counts in layers.values():
            per_rank = counts.reshape(ep, -1).sum(axis=1)
            ratios.append(float(per_rank.max() / per_rank.mean()) if per_rank.sum() else 1.0)
        return float(np.mean(ratios))

    def durations(self, var: Variability, ep: int | None = None) -> list[npt.NDArray[np.float64]]:
        """Per recorded step, ``[stage, mb, kind]`` durations at the recorded loads, with experts
        on ``ep`` ranks (default: the run's)."""
        ep = ep or self.ep
        if ep < 1 or self.experts % ep:
            raise ValueError(f"ep {ep} does not divide the record's {self.experts} experts")
        S, M = self.stages, self.microbatches
        loads = np.array(
            [
                [[self.load(step, s, m, ep) for m in range(M)] for s in range(S)]
                for step in self.steps
            ]
        )
        out = np.zeros((len(self.steps), S, M, 3))
        for k, base in zip(Kind, (var.f, var.b, var.w)):
            routed = var.moe_expert + (0.0 if k == Kind.W else var.moe_a2a)
            t = (1.0 - routed) + routed * loads
            out[..., k] = base * t / t.mean()
        return list(out)
