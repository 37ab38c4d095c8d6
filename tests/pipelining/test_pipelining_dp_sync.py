"""ScheduleReady(dp_sync=True) on pp 2 x dp 2 (4 gloo ranks; stage s of replica d on rank s * 2 +
d): after a step every rank's gradients equal one process's over the whole batch of both replicas
(float64), as do the losses of each replica's microbatches."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M, D, ROWS = (
    2,
    4,
    8,
)  # ROWS: the whole batch, split between the two replicas, then into M microbatches


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Sequential(nn.Linear(D, D), nn.Tanh())
    ).double()


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, D, generator=g, dtype=torch.float64), torch.randn(
        ROWS, D, generator=g, dtype=torch.float64
    )


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _rank(rank, world, dp_sync):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady

    dist.init_process_group("gloo")
    groups = {
        d: dist.new_group([d, 2 + d]) for d in (0, 1)
    }  # every rank creates both, in one order
    s, d = divmod(rank, 2)
    stage = PipelineStage(_model()[s], s, 2, torch.device("cpu"), group=groups[d])
    x, y = _batch()
    half = slice(d * ROWS // 2, (d + 1) * ROWS // 2)
    losses = []
    try:
        with ScheduleReady(stage, M, loss_fn=_loss, timeout_s=60, dp_sync=dp_sync) as schedule:
            if s == 0:
                schedule.step(x[half])
            else:
                schedule.step(target=y[half], losses=losses)
        return (
            s,
            {n: p.grad.tolist() for n, p in stage.submod.named_parameters()},
            [loss.item() for loss in losses],
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_dp_sync_gradients_equal_one_process_over_the_whole_batch():
    import torch

    out = run_ranks(_rank, 4, True, timeout=110)
    model = _model()
    x, y = _batch()
    mbs = list(zip(x.chunk(2 * M), y.chunk(2 * M)))  # replica 0's M microbatches, then replica 1's
    losses = [_loss(model(a), b) for a, b in mbs]
    (sum(losses) / len(losses)).backward()
    for rank, (s, grads, got) in out.items():
        for name, p in model[s].named_parameters():
            torch.testing.assert_close(
                torch.tensor(grads[name], dtype=torch.float64),
                p.grad,
                rtol=1e-12,
                atol=1e-12,
                msg=f"rank {rank} {name}",
            )
        if s == 1:
            d = rank - 2
            assert got == pytest.approx(
                [loss.item() for loss in losses[d * M : (d + 1) * M]], rel=1e-12, abs=0
            )
