"""An FSDP2 stage whose parameter only one replica uses (a branch its data takes, as an MoE expert
that gets no token elsewhere), on pp 1 x dp_shard 2 (2 gloo ranks): the replica without a
gradient reduce-scatters zeros for it, so both replicas' reduce-scatters have one layout, and the
gradients and parameters after 2 AdamW steps equal one process's (float64)."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M, STEPS, D, LR = 2, 2, 4, 0.05


def _model():
    import torch
    from torch import nn

    class Branch(nn.Module):
        """``extra`` runs only for inputs whose first feature is positive: replica 0's."""

        def __init__(self) -> None:
            super().__init__()
            self.base, self.extra = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            y = torch.tanh(self.base(x))
            return self.extra(y) if bool(x[0, 0] > 0) else y

    torch.manual_seed(0)
    return Branch().double()


def _data(step: int):
    """Replica 0's microbatches (first feature positive), then replica 1's (negative)."""
    import torch

    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(2 * M, 3, D, generator=g, dtype=torch.float64)
    x[:M, 0, 0], x[M:, 0, 0] = 1.0, -1.0
    return [(x[i], torch.randn(3, D, generator=g, dtype=torch.float64)) for i in range(2 * M)]


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _rank(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        rt = PipelineRuntime.start(pp=1, dp=2, timeout_s=60)
        try:
            module = _model()
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
            fully_shard(module.extra, mesh=mesh)
            fully_shard(module, mesh=mesh)
            ex = rt.stage_executor(module, _loss, n_microbatches=M, hint="bfw")
            opt = torch.optim.AdamW(module.parameters(), lr=LR)
            for step in range(STEPS):
                opt.zero_grad()
                await ex.run_iteration(step, _data(step)[rt.dp_rank * M : (rt.dp_rank + 1) * M])
                grads = {n: p.grad.full_tensor().tolist() for n, p in module.named_parameters()}
                opt.step()
            return grads, {n: p.full_tensor().tolist() for n, p in module.named_parameters()}
        finally:
            await rt.aclose()

    return run(main())


@pytest.mark.timeout(120)
def test_a_parameter_one_replica_leaves_unused_is_reduced_with_zeros():
    import torch

    out = run_ranks(_rank, 2, timeout=100)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        batch = _data(step)
        (sum(_loss(ref(x), y) for x, y in batch) / len(batch)).backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
    for rank, (got_grads, got_params) in out.items():
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                torch.tensor(got_grads[name], dtype=torch.float64),
                grads[name],
                msg=f"{rank} {name}",
            )
            torch.testing.assert_close(
                torch.tensor(got_params[name], dtype=torch.float64),
                p.detach(),
                msg=f"{rank} {name}",
            )
