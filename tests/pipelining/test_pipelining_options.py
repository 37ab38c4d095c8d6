"""ScheduleReady takes split= and cost= as stage_executor does: split=False runs no W task under a
hint that splits by default; with a cost model a step without cost_features is one clear error on
every rank, and with them it runs. Real gloo ranks."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M, D = 2, 4


def _rank(rank, world):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    import rrfp
    from rrfp import ScheduleReady
    from rrfp.core.tasks import Kind

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(D, D), rank, world, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * M, D, generator=g), torch.randn(2 * M, D, generator=g)
    feats = [rrfp.token_features((a, b)) for a, b in zip(x.chunk(M), y.chunk(M))]
    cost = rrfp.CostModel((((0.03, 0, 0, 0), (0.03, 0, 0, 0), (0.01, 0, 0, 0)),) * world, 0.01)
    out = {}
    try:
        for split in (True, False):
            with ScheduleReady(
                stage, M, loss_fn=loss_fn, hint="bfw", split=split, timeout_s=30
            ) as schedule:
                schedule.step(x) if rank == 0 else schedule.step(target=y)
                out[split] = {t.kind for t in schedule.last_result.order}
        with ScheduleReady(
            stage, M, loss_fn=loss_fn, hint="plan", cost=cost, timeout_s=30
        ) as schedule:
            try:
                schedule.step(x) if rank == 0 else schedule.step(target=y)
            except ValueError as e:
                out["no features"] = str(e)
            schedule.step(x, cost_features=feats) if rank == 0 else schedule.step(
                target=y, cost_features=feats
            )
            out["planned"] = schedule.last_result.plan is not None
        return {
            k: (sorted(int(t) for t in v) if isinstance(v, set) else v) for k, v in out.items()
        }, int(Kind.W)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_schedule_ready_takes_split_and_cost():
    for rank, (out, w) in run_ranks(_rank, 2, timeout=110).items():
        assert w in out[True] and w not in out[False], (rank, out)
        assert "cost_features" in out["no features"] and "\n" not in out["no features"], out[
            "no features"
        ]
        assert out["planned"], rank
