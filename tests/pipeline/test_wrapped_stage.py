"""What PipelineRuntime.stage_executor takes of stage modules wrapped for data parallelism, on
every rank that holds one, before any task runs: DDP, around the stage or inside it, is refused
(rrfp/pipeline/wrapped.py); an FSDP2 stage is taken when it is sharded over the stage's replicas
and every parameter is inside a fully_shard, and refused otherwise, naming why
(rrfp/pipeline/sharded_stages.py)."""

from __future__ import annotations

import re

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

WHO = "PipelineRuntime.stage_executor"
REFUSALS = {
    "ddp": r"^{who} does not support a stage module wrapped in DistributedDataParallel{inside}: "
    r"use rrfp's data parallelism",
    "other ranks": r"^{who}: FSDP module FSDPSequential shards over ranks \[0, 1\], but this "
    r"stage's data-parallel replicas are ranks \[{rank}\]",
    "outside": r"^{who}: parameters \['0.weight', '0.bias'\] are outside every fully_shard",
}


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
    world_mesh = init_device_mesh("cpu", (world,))
    # pp = world: each stage's replicas are the rank itself
    replicas = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp_shard"))["dp_shard"]

    def plain():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def ddp():
        return DistributedDataParallel(plain(), process_group=alone[rank])

    def ddp_inside():
        m = plain()
        m[1] = DistributedDataParallel(m[1], process_group=alone[rank])
        return m

    def over_other_ranks():
        return fully_shard(plain(), mesh=world_mesh)

    def sharded_inside():
        m = plain()
        fully_shard(m[1], mesh=replicas)
        return m

    def sharded():
        m = plain()
        fully_shard(m[1], mesh=replicas)
        return fully_shard(m, mesh=replicas)

    def loss_fn(out, y):
        return out.sum()

    # (what this rank passes, the refusal expected: (name, submodule) or None)
    cases = {
        1: {
            0: [(sharded, None), (sharded_inside, ("outside", ""))],
            1: [(plain, None), (ddp, ("ddp", ""))],
        },
        2: {
            0: [((plain, ddp_inside), ("ddp", "1"))],
            1: [((over_other_ranks, sharded), ("other ranks", ""))],
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
                        rt.stage_executor(modules, loss_fn, n_microbatches=2)
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


def test_stage_executor_refuses_ddp_and_fsdp_it_cannot_run_and_takes_fsdp_over_the_replicas():
    results = run_ranks(_stage_executor_refuses, 2, timeout=90)
    for rank, seen in results.items():
        assert len(seen) == 3, (rank, seen)
        for virtual, expected, error in seen:
            if expected is None:
                assert error is None, (rank, virtual, error)
                continue
            name, sub = expected
            inside = f"; its submodule {sub} is one" if sub else ""
            pattern = REFUSALS[name].format(who=re.escape(WHO), inside=re.escape(inside), rank=rank)
            assert error is not None and re.match(pattern, error), (rank, virtual, error)
