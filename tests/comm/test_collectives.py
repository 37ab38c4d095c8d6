"""Collectives as futures on gloo: TP agreement, DP gradient sync and the
runtime's own all-reduce and gather are async Work awaited through the
loop's one poller, with no thread started per collective."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

ROUNDS = 40


def _threads() -> tuple[int, int]:
    """(Python threads, OS threads of this process)."""
    import os
    import threading

    return threading.active_count(), len(os.listdir("/proc/self/task"))


def _collectives(rank, world, tp, dp):
    import asyncio

    import torch

    from rrfp.core.tasks import B, F, W
    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        out = {}
        async with PipelineRuntime.start(pp=1, tp=tp, dp=dp, timeout_s=30) as rt:
            await rt.all_reduce(torch.zeros(1))  # the first round may start gloo's own machinery
            before = _threads()
            if tp > 1:
                from rrfp.comm.agreement import TPAgreement

                agreement = TPAgreement(rt.tp_control, 4, rt.poller)
                mine = {F(0), B(1), W(rank)}
                for _ in range(ROUNDS):
                    everywhere, somewhere = await agreement.agree(mine)
                out["agreed"] = (sorted(map(str, everywhere)), sorted(map(str, somewhere)))
            if dp > 1:
                module = torch.nn.Linear(3, 2)
                sync = rt.grad_sync(module)
                for i in range(ROUNDS):
                    for p in module.parameters():
                        p.grad = torch.full_like(p, float(rank + i))
                    await sync.sync()
                out["grad"] = module.weight.grad[0, 0].item()
            for _ in range(ROUNDS):
                total = await rt.all_reduce(torch.ones(1))
            out["sum"] = total.item()
            out["gathered"] = await rt.gather_object({"rank": rank, "data": list(range(rank + 2))})
            out["threads"] = (before, _threads())
        return out

    return asyncio.run(main())


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)])
def test_collectives_are_futures_without_threads(tp, dp):
    results = run_ranks(_collectives, 2, tp, dp, timeout=100)
    for rank, out in results.items():
        (py0, os0), (py1, os1) = out["threads"]
        # 3 x 40 collectives: a thread each would show; gloo's fixed pool may not grow either
        assert py1 == py0 and os1 <= os0 + 2, f"rank {rank}: threads {py0}/{os0} -> {py1}/{os1}"
        assert out["sum"] == 2.0
        if tp > 1:
            assert out["agreed"] == (["B1", "F0"], ["B1", "F0", "W0", "W1"])
        if dp > 1:
            assert out["grad"] == pytest.approx(
                0.5 + ROUNDS - 1
            )  # mean of rank + i over ranks 0, 1
    assert results[0]["gathered"] == [{"rank": 0, "data": [0, 1]}, {"rank": 1, "data": [0, 1, 2]}]
    assert results[1]["gathered"] is None


def test_nccl_runtime_refused_without_cuda():
    """Before any process group: a CPU-only torch cannot start an NCCL runtime."""
    import torch

    from rrfp.pipeline.runtime import PipelineRuntime

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; benchmarks/gpu_check.py covers the NCCL runtime")
    with pytest.raises(RuntimeError, match="backend nccl needs CUDA"):
        PipelineRuntime.start(backend="nccl")
    with pytest.raises(ValueError, match="backend 'mpi' is not supported"):
        PipelineRuntime.start(backend="mpi")
