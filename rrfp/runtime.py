"""A rank's place in the pipeline: process group, layout and channels, created
eagerly and in the same order on every rank. Embedding drivers start here."""
from __future__ import annotations

import asyncio
import datetime
import logging
import os

import torch
import torch.distributed as dist

from .budget import Budget
from .comm.channels import create_pipeline_channels
from .comm.topology import Layout
from .executor import ExecutorSettings, StageExecutor
from .hints import default_split, resolve
from .instrument import Instrument
from .loop import make_lane
from .policy import Executor
from .stage import StageWorker
from .variability import Variability

log = logging.getLogger("rrfp.runtime")


class PipelineRuntime:
    """Owns this rank's process group membership, channels and compute lane.

    ``PipelineRuntime.start(pp=4)`` under torchrun; then build this stage's
    module (``runtime.stage`` of ``runtime.num_stages``), get a StageExecutor
    with ``runtime.executor(...)`` and await ``run_iteration`` per step.
    """

    def __init__(self, layout: Layout, rank: int, channels, timeout_s: float, unit_s: float,
                 device: str = "cpu") -> None:
        self.layout, self.rank, self.channels, self.timeout_s = layout, rank, channels, timeout_s
        coords = layout.coords(rank)
        self.stage, self.num_stages = coords.pp, layout.pp
        self.lane = make_lane(device, unit_s, name=f"stage{self.stage}")
        self.unit_s = unit_s

    @classmethod
    def start(cls, *, pp: int = 0, tp: int = 1, dp: int = 1, backend: str = "gloo", timeout_s: float = 60.0,
              unit_ms: float = 0.0) -> "PipelineRuntime":
        """Join (or reuse) the default process group and build every channel."""
        if not dist.is_initialized():
            if "RANK" not in os.environ:
                raise RuntimeError("no RANK in the environment: start the ranks with torchrun "
                                   "(torchrun --nproc-per-node N -m rrfp train ...)")
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = Layout(world, pp or world // (tp * dp), tp, dp)
        if tp > 1 or dp > 1:
            raise NotImplementedError("tensor and data parallelism are not implemented yet; use tp = dp = 1")
        channels = create_pipeline_channels(layout, rank, datetime.timedelta(seconds=timeout_s))
        log.info("rank %d is stage %d of %d", rank, layout.coords(rank).pp, layout.pp)
        return cls(layout, rank, channels, timeout_s, unit_ms / 1000.0)

    def executor(self, module: torch.nn.Module, loss_fn, *, microbatches: int, executor: str = "ready",
                 hint: str = "bfw", budget: str = "2x", split: bool | None = None,
                 variability: Variability | None = None, seed: int = 0,
                 instrument: Instrument | None = None) -> StageExecutor:
        h = resolve(hint)
        split = default_split(h.name) if split is None else split
        settings = ExecutorSettings(Executor(executor), h, Budget.parse(budget), split, microbatches,
                                    variability or Variability(), seed, self.timeout_s)
        worker = StageWorker(module, self.stage, self.num_stages, microbatches, loss_fn, split)
        return StageExecutor(worker, self.channels, self.lane, settings, self.rank, instrument, self.unit_s)

    async def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """A world all-reduce off the loop thread (gloo collectives block)."""
        await asyncio.to_thread(dist.all_reduce, tensor, op)
        return tensor

    async def gather_object(self, obj) -> list | None:
        out = [None] * dist.get_world_size() if self.rank == 0 else None
        await asyncio.to_thread(dist.gather_object, obj, out, 0)
        return out

    async def aclose(self) -> None:
        self.lane.close()
        await self.channels.aclose()
