"""on_nonfinite for embedding drivers (stage_executor): a NaN loss on one microbatch of the last
stage, whose gradients stay finite, so only that rank sees it. "stop" ends every rank with one line
naming the stage and the microbatch; "skip" leaves every rank's parameters as they were after the
user's optimizer step. Real gloo ranks."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M, D = 3, 4


def _rank(rank, world, policy):
    import asyncio

    import torch
    from torch import nn

    import rrfp
    from rrfp.core.errors import NonFiniteError

    def loss_fn(out, target):
        y, bad = target
        loss = ((out - y) ** 2).mean()
        return (
            loss + float("nan") if bad else loss
        )  # a NaN in the loss only: the gradients stay finite

    torch.manual_seed(rank)
    stage = nn.Linear(D, D)
    before = [p.detach().clone() for p in stage.parameters()]
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(2, D, generator=g), (torch.randn(2, D, generator=g), mb == 1))
        for mb in range(M)
    ]

    async def main():
        async with rrfp.PipelineRuntime.start(pp=world, timeout_s=30) as rt:
            ex = rt.stage_executor(stage, loss_fn, n_microbatches=M, on_nonfinite=policy)
            opt = torch.optim.SGD(stage.parameters(), lr=0.5)
            try:
                result = await ex.run_iteration(0, batches)
            except NonFiniteError as e:
                return "raised", str(e), None
            opt.step()
            same = all(torch.equal(p, q) for p, q in zip(stage.parameters(), before))
            return "returned", result.skipped, same

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_nan_loss_stops_every_rank_naming_stage_and_microbatch():
    out = run_ranks(_rank, 2, "stop", timeout=80)
    for rank, (how, text, _) in out.items():
        assert how == "raised", (rank, how)
        assert (
            "\n" not in text and "stage 1 microbatch 1" in text and text.startswith(f"rank {rank}:")
        ), text


@pytest.mark.timeout(90)
def test_skip_leaves_every_rank_parameters_unchanged_after_the_optimizer_step():
    out = run_ranks(_rank, 2, "skip", timeout=80)
    for rank, (how, skipped, same) in out.items():
        assert how == "returned" and skipped, (rank, how, skipped)
        assert same, f"rank {rank}: the optimizer step moved the parameters"
