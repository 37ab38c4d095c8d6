"""Under DP with the executor attached, gradients accumulated over several
iterations before one ``sync()`` are all averaged: the buckets launched early by
the first iteration are stale once a later iteration adds to the gradients, so
``sync()`` averages them afresh. Checked against the single-process reference."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks
from harness.dp_mlp import M, data, model, reference

pytestmark = pytest.mark.multirank

ITERATIONS = 2


def _accumulate(rank, world, hint):
    import asyncio

    from torch import nn

    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        async with PipelineRuntime.start(pp=1, dp=world, timeout_s=30) as rt:
            m = model()
            ex = rt.stage_executor(m, nn.functional.mse_loss, n_microbatches=M, hint=hint)
            sync = rt.grad_sync(m, ex)
            for step in range(2):  # the second step shows the first left no stale state behind
                m.zero_grad(set_to_none=True)
                for it in range(ITERATIONS):
                    await ex.run_iteration(step * ITERATIONS + it, data(rt.dp_rank, it))
                await sync.sync()
            return {n: p.grad.tolist() for n, p in m.named_parameters()}, sync.launched_early

    return asyncio.run(main())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hint", ["bf", "bfw"])
def test_gradients_accumulated_over_iterations_are_all_averaged(hint):
    import torch

    results = run_ranks(_accumulate, 2, hint, timeout=75)
    ref = reference(2, ITERATIONS)
    for rank, (grads, launched_early) in results.items():
        for name, want in ref.items():
            assert torch.allclose(
                torch.tensor(grads[name]), torch.tensor(want), rtol=0, atol=1e-12
            ), (
                f"rank {rank} ({hint}): {name} is not the replicas' mean of the accumulated "
                "gradients"
            )
        assert launched_early == 2, "the first iteration of each step launched its bucket early"
