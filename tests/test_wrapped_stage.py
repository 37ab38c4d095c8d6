"""A stage module wrapped for data parallelism (DDP, FSDP2's fully_shard), around the stage or
inside it, is refused by PipelineRuntime.stage_executor with ScheduleReady's message, on every
rank that holds one, before any task runs (rrfp/pipeline/wrapped.py)."""

from __future__ import annotations

import re

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.multirank

WHO = "PipelineRuntime.stage_executor"
WRAPPED = (
    r"^{who} does not support a stage module wrapped in {cls} \(data parallelism inside the "
    r"stage\) yet{inside}$"
)


def _stage_executor_refuses(rank, world):
    import asyncio
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from rrfp.pipeline.runtime import PipelineRuntime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    alone = [dist.new_group([r]) for r in range(world)]  # every rank creates both, in one order
    mesh = init_device_mesh("cpu", (world,))

    def plain():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def ddp():
        return DistributedDataParallel(plain(), process_group=alone[rank])

    def sharded_inside():
        m = plain()
        fully_shard(m[1], mesh=mesh)
        return m

    def sharded():
        return fully_shard(plain(), mesh=mesh)

    def loss_fn(out, y):
        return out.sum()

    # (what this rank passes, the refusal expected: (class, submodule) or None)
    cases = {
        1: {
            0: [(plain, None), (sharded_inside, ("FSDPLinear", "1"))],
            1: [(plain, None), (ddp, ("DistributedDataParallel", ""))],
        },
        2: {
            0: [((plain, ddp), ("DistributedDataParallel", ""))],
            1: [((sharded, plain), ("FSDPSequential", ""))],
        },
    }
    seen = []

    async def main():
        for virtual, per_rank in cases.items():
            rt = PipelineRuntime.start(pp=world, timeout_s=60, virtual=virtual)
            try:
                for build, expected in per_rank[rank]:
                    modules = [b() for b in build] if isinstance(build, tuple) else build()
                    try:
                        rt.stage_executor(modules, loss_fn, microbatches=2)
                        seen.append((virtual, expected, None))
                    except NotImplementedError as e:
                        seen.append((virtual, expected, str(e)))
            finally:
                await rt.aclose()

    try:
        asyncio.run(main())
    finally:
        dist.destroy_process_group()
    return seen


def test_stage_executor_refuses_ddp_and_fsdp_stage_modules():
    results = run_ranks(_stage_executor_refuses, 2, timeout=90)
    for rank, seen in results.items():
        assert len(seen) == 3, (rank, seen)
        for virtual, expected, error in seen:
            if expected is None:
                assert error is None, (rank, virtual, error)
                continue
            cls, sub = expected
            inside = f"; its submodule {sub} is one" if sub else ""
            pattern = WRAPPED.format(who=re.escape(WHO), cls=cls, inside=re.escape(inside))
            assert error is not None and re.match(pattern, error), (rank, virtual, error)
