"""Under DP, sparse gradients (``nn.Embedding(sparse=True)``) are averaged over the
replicas and handed back sparse, so ``SparseAdam`` can step: through the executor,
and for an embedding only one replica used (the other learns it is sparse from the
all-reduce). Checked against the single-process reference."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M = 2


class Net:
    """Built in the ranks (torch is imported there): two sparse embeddings and a dense layer."""

    @staticmethod
    def make():
        import torch
        from torch import nn

        class _Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.e, self.e2, self.l = (
                    nn.Embedding(7, 4, sparse=True),
                    nn.Embedding(5, 4, sparse=True),
                    nn.Linear(4, 2),
                )

            def forward(self, ids, extra=False):
                h = self.e(ids)
                return self.l(h + self.e2(ids % 5) if extra else h)

        torch.manual_seed(0)
        return _Net().double()


def _data(replica):
    import torch

    g = torch.Generator().manual_seed(replica)
    return [
        (
            torch.randint(0, 7, (2, 3), generator=g),
            torch.randn(2, 3, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(M)
    ]


def _reference(world, extra_on):
    """Gradients of the mean loss over all replicas' microbatches in one process (dense, as lists);
    replica r's forward uses e2 only if r is in ``extra_on``."""
    from torch import nn

    ref = Net.make()
    losses = [
        nn.functional.mse_loss(ref(x, r in extra_on), y) for r in range(world) for x, y in _data(r)
    ]
    (sum(losses) / len(losses)).backward()
    return {
        n: None if p.grad is None else p.grad.to_dense().tolist() for n, p in ref.named_parameters()
    }


def _grads(m):
    return {
        n: None if p.grad is None else (p.grad.is_sparse, p.grad.to_dense().tolist())
        for n, p in m.named_parameters()
    }


def _sparse(rank, world):
    import asyncio

    import torch
    from torch import nn

    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        async with PipelineRuntime.start(pp=1, dp=world, timeout_s=30) as rt:
            m = Net.make()
            ex = rt.stage_executor(m, nn.functional.mse_loss, n_microbatches=M, hint="bfw")
            sync = rt.grad_sync(m, ex)
            await ex.run_iteration(0, _data(rt.dp_rank))
            await sync.sync()
            through_executor = _grads(m)

            m = Net.make()
            sync = rt.grad_sync(m)
            data = _data(rt.dp_rank)
            (
                sum(nn.functional.mse_loss(m(x, rt.dp_rank == 0), y) for x, y in data) / len(data)
            ).backward()
            local = _grads(m)
            await sync.sync()
            one_replica = _grads(m)
            opt = torch.optim.SparseAdam([m.e.weight, m.e2.weight], lr=0.1)
            opt.step()  # refuses dense gradients
            return through_executor, local, one_replica, m.e2.weight.tolist()

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_sparse_gradients_are_averaged_and_stay_sparse():
    import torch

    results = run_ranks(_sparse, 2, timeout=75)
    refs = {"executor": _reference(2, set()), "one replica": _reference(2, {0})}
    for rank, (through_executor, _local, one_replica, _e2_after) in results.items():
        for case, got in (("executor", through_executor), ("one replica", one_replica)):
            ref = refs[case]
            for name, want in ref.items():
                if want is None:
                    assert got[name] is None, (
                        f"rank {rank} {case}: {name} unused everywhere keeps no gradient"
                    )
                    continue
                sparse, values = got[name]
                assert sparse == name.startswith("e"), f"rank {rank} {case}: {name} sparse={sparse}"
                assert torch.allclose(
                    torch.tensor(values), torch.tensor(want), rtol=0, atol=1e-12
                ), f"rank {rank} {case}: {name} is not the replicas' mean"
    assert results[1][1]["e2.weight"] is None, (
        "replica 1 never used e2: it had no gradient of its own"
    )
    assert results[0][3] == results[1][3], "SparseAdam moved e2 alike on both replicas"
