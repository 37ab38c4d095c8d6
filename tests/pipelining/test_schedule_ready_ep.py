"""The Llama mixture of experts through ``ScheduleReady`` with expert parallelism: a
``("pp", "dp", "ep")`` mesh of 2 x 1 x 2 gloo ranks, the experts sharded by the script over
``mesh["ep"]``, float64, 3 AdamW steps with the auxiliary loss and the bias update on: losses and
parameters (each member's experts, its slice) equal one process training the whole model."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

M, ROWS, T, STEPS, LR, E = 2, 8, 8, 3, 1e-2, 4


def _cfg():
    from rrfp.models.llama import LlamaConfig

    return LlamaConfig(
        n_layer=3,
        n_embd=16,
        n_head=2,
        n_kv_head=1,
        intermediate_size=24,
        block_size=T,
        moe_experts=E,
        moe_top_k=2,
        moe_intermediate_size=12,
        moe_aux_loss_coeff=0.05,
        moe_bias_update_rate=0.01,
    )


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 256, (ROWS, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _state(module) -> dict:
    keep = set(module.state_dict())
    items = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.detach().clone() for n, t in items if n in keep}


def _rank(rank, world, hint):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from rrfp import MoELayer, ScheduleReady, shard_experts
    from rrfp.models.llama import Llama, loss_fn

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "ep"))
    s, d = divmod(rank, 2)
    torch.manual_seed(0)
    module = Llama(_cfg(), s, 2)
    assert shard_experts(module, mesh["ep"].get_group()) > 0
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    stage = PipelineStage(module, s, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    half = slice(d * ROWS // 2, (d + 1) * ROWS // 2)
    losses = []
    try:
        with ScheduleReady(stage, M, loss_fn=loss_fn, timeout_s=60, mesh=mesh, hint=hint) as sched:
            for step in range(STEPS):
                x, y = _batch(step)
                mine: list = []
                if s == 0:
                    sched.step(x[half])
                else:
                    sched.step(target=y[half], losses=mine)
                losses.append([loss.item() for loss in mine])
                opt.step()
                opt.zero_grad()
                for layer in layers:  # the bias update, from both replicas' load
                    load = layer.take_step().tokens_per_expert
                    dist.all_reduce(load, group=mesh["ep"].get_group())
                    layer.update_bias(load)
        return s, d, {n: t.numpy() for n, t in _state(module).items()}, losses
    finally:
        dist.destroy_process_group()


def _reference():
    import torch

    from rrfp import MoELayer, collect_aux_losses
    from rrfp.models.llama import Llama, loss_fn

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Llama(_cfg())
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step)
            mbs = list(zip(x.chunk(2 * M), y.chunk(2 * M)))  # replica 0's, then replica 1's
            ces, total = [], 0
            for a, b in mbs:
                with collect_aux_losses() as aux:
                    ce = loss_fn(model(a), b)
                ces.append(ce.item())
                total = total + ce + sum(aux)
            (total / len(mbs)).backward()
            opt.step()
            opt.zero_grad()
            for layer in layers:
                layer.update_bias(layer.take_step().tokens_per_expert)
            losses.append(ces)
        return _state(model), losses
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hint", ["bfw", "zbh1"])
def test_schedule_ready_with_an_ep_mesh_equals_one_process(hint):
    import torch

    want, want_losses = _reference()
    k = E // 2
    for rank, (s, d, state, losses) in run_ranks(_rank, 4, hint, timeout=200).items():
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
