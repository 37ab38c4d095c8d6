"""The Llama mixture of experts trained by a script through ``ScheduleReady`` on pp 2 x 2
replicas (float64, 3 AdamW steps, the auxiliary loss and the bias update on), and one process
training the whole model on both replicas' batch: what the drop-in's MoE tests compare."""

from __future__ import annotations

import functools

from harness.whole_model import float64

M, ROWS, T, STEPS, LR = 2, 8, 8, 3, 1e-2  # ROWS: the whole batch, half to each replica


def config(**more):
    from rrfp.models.llama import LlamaConfig

    base = dict(
        n_layer=3,
        n_embd=16,
        n_head=2,
        n_kv_head=1,
        intermediate_size=24,
        block_size=T,
        moe_experts=4,
        moe_top_k=2,
        moe_intermediate_size=12,
        moe_aux_loss_coeff=0.05,
        moe_bias_update_rate=0.01,
    )
    return LlamaConfig(**{**base, **more})


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 256, (ROWS, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def module_state(module) -> dict:
    keep = set(module.state_dict())
    items = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.detach().clone() for n, t in items if n in keep}


def train_replica(schedule, module, stage: int, replica: int, load_group) -> list[list[float]]:
    """Replica ``replica``'s half of each step's batch through ``schedule``, the script's AdamW
    step, and DeepSeek-V3's bias update from the load summed over ``load_group``: the losses of
    each step (on the last stage)."""
    import torch
    import torch.distributed as dist

    from rrfp import MoELayer

    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    half = slice(replica * ROWS // 2, (replica + 1) * ROWS // 2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        mine: list = []
        if stage == 0:
            schedule.step(x[half])
        else:
            schedule.step(target=y[half], losses=mine)
        losses.append([loss.item() for loss in mine])
        opt.step()
        opt.zero_grad()
        for layer in layers:
            load = layer.take_step().tokens_per_expert
            dist.all_reduce(load, group=load_group)
            layer.update_bias(load)
    return losses


def reference(cfg):
    """One process, the whole model, both replicas' microbatches: (state, each step's losses)."""
    import torch

    from rrfp import MoELayer, collect_aux_losses
    from rrfp.models.llama import Llama, loss_fn

    with float64():
        torch.manual_seed(0)
        model = Llama(cfg)
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
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
        return module_state(model), losses


@functools.cache
def reference_of(**more):
    """``reference(config(**more))``, computed once per test process: the parametrized tests share
    it and none changes what it returns."""
    return reference(config(**more))
