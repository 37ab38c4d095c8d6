"""Where a task's emulated device time comes from, and what of it can be known
before the iteration runs.

Two sources: the variability preset alone, or a cost model of the
microbatch's data times the preset's noise. The runtime's lane, the bench's
torch anchors and the planner all read task times here, so every executor
runs the same durations and the planner sees exactly their predictable part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from rrfp.core.cost import CostModel, Features
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability


def known(variability: Variability) -> Variability:
    """What a planner may know of a preset: per-microbatch size factors and a
    persistently slow stage. Jitter, stragglers, link jitter and the router's load (decided as
    the task runs) stay hidden: a routed task is planned at its mean."""
    return replace(variability, jitter=0.0, straggler_p=0.0, comm_jitter=0.0, moe_excess=0.0)


@dataclass(frozen=True)
class TaskTimes:
    """Task durations in units of the average forward, for one run's settings."""

    variability: Variability
    seed: int = 0
    split: bool = True
    cost: CostModel | None = None  # with features: the data's predicted cost times the noise
    layout: VirtualLayout | None = None  # virtual stages: ``stage`` is global, of layout.num_stages

    @property
    def virtual(self) -> int:
        """V: with the preset, a local stage's task takes 1/V of the V = 1 stage's time (same model
        depth, same work per rank); a cost model is fitted per global stage already."""
        return 1 if self.layout is None else self.layout.virtual

    def _local_scale(self, layout: VirtualLayout, stage: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """What turns a draw at global ``stage`` into a local stage's time: 1/V without a cost
        model, and ``slow_stage`` read as a rank (all its local stages slow) rather than a global
        stage."""
        var, V = self.variability, layout.virtual
        scale = np.full(np.shape(stage), 1.0 / V if self.cost is None else 1.0)
        if var.slow_stage >= 0:
            slow = (
                np.isin(stage, layout.stages_of(var.slow_stage))
                if var.slow_stage < layout.ranks
                else False
            )
            scale = scale * np.where(slow, var.slow_factor, 1.0)
        return scale

    def _per_stage(self) -> TaskTimes:
        return replace(self, variability=replace(self.variability, slow_stage=-1), layout=None)

    def units(
        self,
        iteration: int,
        stage: int,
        mb: int,
        kind: Kind | int,
        features: Sequence[Features] | None = None,
    ) -> float:
        """The realized duration of one task."""
        layout = self.layout
        if layout is not None and layout.virtual > 1:
            return self._per_stage().units(iteration, stage, mb, kind, features) * float(
                self._local_scale(layout, stage)
            )
        var = self.variability
        if self.cost is not None and features is not None:
            return self.cost.units(stage, int(kind), features[mb], self.split) * var.noise(
                self.seed, iteration, stage, mb, kind
            )
        return var.duration(self.seed, iteration, stage, mb, kind, self.split)

    def realized(
        self,
        iteration: int,
        stages: int,
        n_microbatches: int,
        features: Sequence[Features] | None = None,
    ) -> npt.NDArray[np.float64]:
        """``[stage, mb, kind]``: every task's duration as the lane holds it (W is zero without a
        split backward: B holds it); what the simulator draws, the bench bounds and a replay runs.
        With virtual stages ``stages`` is S x V and each draw is the local stage's
        (``_local_scale``): the draws themselves are keyed by global stage, so with V = 1 they are
        the plain pipeline's."""
        layout = self.layout
        if layout is not None and layout.virtual > 1:
            if stages != layout.num_stages:
                raise ValueError(f"{stages} stages asked of a layout of {layout.num_stages}")
            out = self._per_stage().realized(iteration, stages, n_microbatches, features)
            return out * self._local_scale(layout, np.arange(stages))[:, None, None]
        S, M, var = stages, n_microbatches, self.variability
        out = np.zeros((S, M, 3))
        s_idx, m_idx = np.arange(S)[:, None], np.arange(M)[None, :]
        for k in (Kind.F, Kind.B, Kind.W) if self.split else (Kind.F, Kind.B):
            if self.cost is not None and features is not None:
                cost = [
                    [self.cost.units(s, int(k), features[m], self.split) for m in range(M)]
                    for s in range(S)
                ]
                out[:, :, k] = np.array(cost) * var.noise(self.seed, iteration, s_idx, m_idx, k)
            else:
                out[:, :, k] = var.duration(self.seed, iteration, s_idx, m_idx, k, self.split)
        return out

    def predicted(
        self,
        iteration: int,
        stages: int,
        n_microbatches: int,
        features: Sequence[Features] | None = None,
    ) -> npt.NDArray[np.float64]:
        """``[stage, mb, kind]``: the part of every duration that is known before the
        iteration starts: ``realized`` with what cannot be known taken out."""
        return replace(self, variability=known(self.variability)).realized(
            iteration, stages, n_microbatches, features
        )

    def latencies(
        self, iteration: int, stages: int, n_microbatches: int
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """``[stage, mb]`` link latencies of every F message and every B message."""
        s_idx, m_idx = np.arange(stages)[:, None], np.arange(n_microbatches)[None, :]
        ones = np.ones((stages, n_microbatches))
        f, b = (
            self.variability.latency(self.seed, iteration, s_idx, m_idx, k) * ones
            for k in (Kind.F, Kind.B)
        )
        return f, b

    def latency(self, iteration: int, stage: int, mb: int, kind: Kind | int) -> float:
        """Link latency of the message a task of ``kind`` on ``stage`` sends."""
        return self.variability.latency(self.seed, iteration, stage, mb, kind)
