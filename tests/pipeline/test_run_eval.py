"""StageExecutor.run_eval: a forward-only iteration on real gloo ranks gives the last stage's losses
of one process on the same model and data (float64), runs no backward task, leaves every gradient
alone, and a training iteration after it still runs on the same channels."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M, D = 3, 4


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh()).double()


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(2, D, generator=g, dtype=torch.float64),
            torch.randn(2, D, generator=g, dtype=torch.float64),
        )
        for _ in range(M)
    ]


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _eval_rank(rank, world):
    import asyncio

    import rrfp
    from rrfp.core.tasks import Kind

    stage = _model()[2 * rank : 2 * rank + 2]
    batches = _data()

    async def main():
        async with rrfp.PipelineRuntime.start(pp=world, timeout_s=30) as rt:
            ex = rt.stage_executor(stage, _loss, n_microbatches=M)
            result = await ex.run_eval(0, batches)
            untouched = all(p.grad is None for p in stage.parameters())
            trained = await ex.run_iteration(1, batches)
            return (
                result.losses,
                {t.kind for t in result.order},
                len(result.order),
                untouched,
                trained.losses,
                {int(Kind.F)} == {int(t.kind) for t in result.order},
            )

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_run_eval_gives_the_losses_of_one_process_and_touches_no_gradient():
    import torch

    out = run_ranks(_eval_rank, 2, timeout=80)
    model = _model()
    with torch.no_grad():
        expected = [_loss(model(x), y).item() for x, y in _data()]
    for rank, (losses, kinds, n, untouched, trained, only_f) in out.items():
        assert only_f and n == M, (rank, kinds, n)  # forward tasks only, one per microbatch
        assert untouched, f"rank {rank}: run_eval touched a gradient"
        if rank == 1:
            assert sorted(losses) == list(range(M))
            assert [losses[mb] for mb in range(M)] == pytest.approx(expected, rel=1e-12, abs=0)
            assert [trained[mb] for mb in range(M)] == pytest.approx(expected, rel=1e-12, abs=0)
        else:
            assert losses == {} and trained == {}
