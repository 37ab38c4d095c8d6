"""The bench's drop-in contender: a workload's stage module behind torch's
``PipelineStage`` and run by ``rrfp.ScheduleReady``, as a torch.distributed.pipelining
user would switch to it, with the emulated durations every other executor gets.

``ScheduleReady`` starts its own runtime (channels, lane, loop thread), so the
emulation reaches it through its hooks: the lane's ``unit_ms``, the executor's
variability, seed, cost model and trace recorder, and each step's features.
Everything else is the public surface: ``step(arg_mbs=..., target_mbs=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.pipelining import PipelineStage

from rrfp.pipelining import ScheduleReady


class TorchCall(torch.nn.Module):
    """A workload stage as torch's PipelineStage calls it, ``submod(*args)``: rrfp's workloads take
    one input (a tensor, or the tuple a stage sends), as the torch anchors' envelope passes it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(args[0] if len(args) == 1 else args)


class EmulatedScheduleReady(ScheduleReady):
    """ScheduleReady whose lane holds each task for its emulated duration (as ``rrfp train`` and
    the bench's other runners do) and whose executor draws the same durations."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn,
        *,
        unit_ms: float,
        instrument,
        **kwargs,
    ) -> None:
        self._unit_ms = unit_ms
        self._instrument = instrument  # the durations' settings come in kwargs' settings=
        self.features: Sequence[dict] | None = None  # the next step's, set by the caller
        super().__init__(stage, n_microbatches, loss_fn, **kwargs)

    def _emulation(self) -> dict:
        return {"instrument": self._instrument}

    def _features(self):
        return None if self.features is None else list(self.features)

    @property
    def steps(self) -> int:
        """Steps taken so far: the executor's iteration number of the next one."""
        return self._iteration
