"""Under DP, the gradient buckets follow ``requires_grad``: a layer unfrozen after
``grad_sync()`` was built is averaged like the rest (progressive unfreezing), and a
layer frozen later is left out, its stale gradient untouched rather than averaged.
Each step's gradients are checked against the single-process reference."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks
from harness.dp_mlp import M, data, model, reference

pytestmark = pytest.mark.multirank


def _steps(rank, world):
    import asyncio
    import logging

    import torch
    from torch import nn

    from rrfp.pipeline.runtime import PipelineRuntime

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    logger = logging.getLogger("rrfp.comm.grad_sync")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)

    async def main():
        async with PipelineRuntime.start(pp=1, dp=world, timeout_s=30) as rt:
            m = model()
            m[0].requires_grad_(False)  # frozen when the sync is built
            ex = rt.stage_executor(m, nn.functional.mse_loss, n_microbatches=M, hint="bfw")
            sync = rt.grad_sync(m, ex)
            steps = []
            for step in range(3):
                if step == 1:
                    m[0].requires_grad_(True)  # progressive unfreezing
                if step == 2:
                    m[2].requires_grad_(
                        False
                    )  # and the last layer frozen, a stale gradient left on it
                    for p in m[2].parameters():
                        p.grad = torch.full_like(p, float(rank + 1))
                await ex.run_iteration(step, data(rt.dp_rank))
                await sync.sync()
                # plain lists: tensors would travel back through shared memory, gone with the
                # process
                steps.append(
                    {
                        n: None if p.grad is None else p.grad.tolist()
                        for n, p in m.named_parameters()
                    }
                )
                m.zero_grad(set_to_none=True)
            return steps, list(lines.lines), sync.launched_early

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_buckets_follow_requires_grad_across_steps():
    results = run_ranks(_steps, 2, timeout=75)
    ref = reference(2)

    def close(got, name):
        import torch

        return got is not None and torch.allclose(
            torch.tensor(got), torch.tensor(ref[name]), rtol=0, atol=1e-12
        )

    for rank, (steps, lines, launched_early) in results.items():
        frozen, unfrozen, refrozen = steps
        assert frozen["0.weight"] is None and frozen["0.bias"] is None
        assert close(frozen["2.weight"], "2.weight") and close(frozen["2.bias"], "2.bias")
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            assert close(unfrozen[name], name), (
                f"rank {rank}: {name} after unfreezing is not the replicas' mean"
            )
        assert close(refrozen["0.weight"], "0.weight") and close(refrozen["0.bias"], "0.bias")
        for name in ("2.weight", "2.bias"):
            assert {v for row in _rows(refrozen[name]) for v in row} == {float(rank + 1)}, (
                f"rank {rank}: the frozen {name}'s own gradient was averaged over the replicas"
            )
        rebuilt = [line for line in lines if "rebuilt" in line]
        assert len(rebuilt) == 2, f"rank {rank}: one INFO line per rebuild, got {lines}"
        assert "4 parameters require grad now (2 before)" in rebuilt[0]
        assert "2 parameters require grad now (4 before)" in rebuilt[1]
        assert launched_early == 3, "each step's one bucket went out from inside the iteration"


def _rows(values):
    return values if isinstance(values[0], list) else [values]
