"""The Llama mixture of experts through ``ScheduleReady`` with expert parallelism: a
``("pp", "dp", "ep")`` mesh of 2 x 1 x 2 gloo ranks, the experts sharded by the script over
``mesh["ep"]``, float64, 3 AdamW steps with the auxiliary loss and the bias update on: losses and
parameters (each member's experts, its slice) equal one process training the whole model. The same
on a ``("pp", "dp_shard", "ep")`` mesh, FSDP2 holding the rest of each stage sharded over its
replicas (the experts left out of ``fully_shard``: the EP group shards them)."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks
from harness.moe_schedule_ready import M, config, module_state, reference_of, train_replica

pytestmark = pytest.mark.multirank


def _rank(rank, world, hint, dp_dim):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    from rrfp import ExpertParallel, ScheduleReady, shard_experts
    from rrfp.models.llama import Llama, loss_fn

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", dp_dim, "ep"))
    s, d = divmod(rank, 2)
    torch.manual_seed(0)
    module = Llama(config(), s, 2)
    assert shard_experts(module, mesh["ep"].get_group()) > 0
    if dp_dim == "dp_shard":  # the rest over every replica of the stage, as torchtitan does
        experts = {
            p for m in module.modules() if isinstance(m, ExpertParallel) for p in m.parameters()
        }
        replicas = mesh["dp_shard", "ep"]._flatten()
        fully_shard(module, mesh=replicas, ignored_params=experts)
    stage = PipelineStage(module, s, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    try:
        with ScheduleReady(stage, M, loss_fn=loss_fn, timeout_s=60, mesh=mesh, hint=hint) as sched:
            losses = train_replica(sched, module, s, d, mesh["ep"].get_group())
        if dp_dim == "dp_shard":  # FSDP holds all but the experts, which stay whole here
            kept = [isinstance(p, DTensor) != (p in experts) for p in module.parameters()]
            assert all(kept), "fully_shard took what was not an expert, and no expert"
        state = module_state(module)
        whole = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in state.items()}
        return s, d, {n: t.numpy() for n, t in whole.items()}, losses
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp_dim", ["dp", "dp_shard"])
@pytest.mark.parametrize("hint", ["bfw", "zbh1"])
def test_schedule_ready_with_an_ep_mesh_equals_one_process(hint, dp_dim):
    import torch

    want, want_losses = reference_of()
    k = config().moe_experts // 2
    for rank, (s, d, state, losses) in run_ranks(_rank, 4, hint, dp_dim, timeout=200).items():
        sharded = [n for n in state if n.endswith(("experts.w1", "experts.w2", "experts.w3"))]
        assert sharded, "the MoE layers' experts are sharded"
        for n, v in state.items():
            expect = want[n][d * k : (d + 1) * k] if n in sharded else want[n]
            torch.testing.assert_close(
                torch.from_numpy(v), expect, rtol=1e-11, atol=1e-13, msg=f"rank {rank} {n}"
            )
        if s == 1:
            for step, got in enumerate(losses):
                assert got == pytest.approx(want_losses[step][d * M : (d + 1) * M], abs=1e-12)
