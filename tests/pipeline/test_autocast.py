"""The caller's autocast reaches every F, B and W of the call (rrfp/pipeline/thread_state.py):
``with torch.autocast("cpu", torch.bfloat16)`` around ``ScheduleReady.step``/``eval`` and around
``await stage_executor(...).run_iteration(...)``, and ``compute.autocast = "bfloat16"`` for ``rrfp
train``, match a one-process bfloat16 run of the same model and data within bfloat16 tolerance, and
differ measurably from the float32 run, on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

M, DIM, BATCH = 2, 16, 4
BF16 = torch.bfloat16
CLOSE = (
    1e-3  # relative: pipeline vs one process, both bfloat16 (the same ops, summed in another order)
)
APART = 3e-3  # relative: bfloat16 vs float32, which a run that dropped autocast would match instead


def full_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)) for _ in range(2)]
    )


def loss_fn(out, target):
    return ((out.float() - target) ** 2).mean()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH * M, DIM, generator=g), torch.randn(BATCH * M, DIM, generator=g)


def reference(bf16: bool) -> tuple[nn.Sequential, torch.Tensor]:
    """One process: each microbatch's loss / M backpropagated, autocast or not; the eval output."""
    model = full_model()
    x, y = data()
    with torch.autocast("cpu", BF16, enabled=bf16):
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (loss_fn(model(xm), ym) / M).backward()
        with torch.no_grad():
            out = model(x)
    return model, out


def relative(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def _both_paths(rank, world):
    import asyncio

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady
    from rrfp.pipeline.runtime import PipelineRuntime

    dist.init_process_group("gloo")
    x, y = data()
    first, last = rank == 0, rank == world - 1
    out = {}
    try:
        chunk = copy.deepcopy(full_model()[rank])
        with ScheduleReady(
            PipelineStage(chunk, rank, world, torch.device("cpu")), M, loss_fn=loss_fn
        ) as schedule:
            with torch.autocast("cpu", BF16):
                schedule.step(*((x,) if first else ()), target=y if last else None)
            grads = {n: p.grad.numpy().copy() for n, p in chunk.named_parameters()}
            with torch.autocast("cpu", BF16), torch.no_grad():
                evaluated = schedule.eval(*((x,) if first else ()), target=y if last else None)
        # plain arrays: a tensor through the result queue needs its sender alive
        out["ScheduleReady"] = (
            grads,
            None if evaluated is None else (evaluated.dtype, evaluated.float().numpy()),
        )

        async def embedded():
            async with PipelineRuntime.start(pp=world, timeout_s=60) as rt:
                module = copy.deepcopy(full_model()[rt.stage])
                ex = rt.stage_executor(
                    module, loss_fn, n_microbatches=M, hint="bfw"
                )  # split: B and W
                batches = list(zip(x.chunk(M), y.chunk(M)))
                with torch.autocast("cpu", BF16):
                    await ex.run_iteration(0, batches)
                return {n: p.grad.numpy().copy() for n, p in module.named_parameters()}

        out["stage_executor"] = (asyncio.run(embedded()), None)
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def pipelined():
    return run_ranks(_both_paths, 2, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", ["ScheduleReady", "stage_executor"])
def test_autocast_around_the_call_reaches_every_task(pipelined, path):
    bf16, bf16_out = reference(bf16=True)
    fp32, _ = reference(bf16=False)
    for rank, result in pipelined.items():
        grads, evaluated = result[path]
        grads = {n: torch.from_numpy(g) for n, g in grads.items()}
        want = {n: p.grad for n, p in bf16[rank].named_parameters()}
        far = {n: p.grad for n, p in fp32[rank].named_parameters()}
        assert relative(far, want) > APART, "the model is one where bfloat16 shows"
        assert relative(grads, want) < CLOSE, (
            f"{path} rank {rank}: not the one-process bfloat16 gradients"
        )
        assert relative(grads, far) > APART, (
            f"{path} rank {rank}: float32 gradients: autocast was dropped"
        )
        if path == "ScheduleReady" and rank == 1:  # eval (the forward-only path) under autocast too
            dtype, values = evaluated
            assert dtype == BF16, dtype
            assert torch.allclose(torch.from_numpy(values), bf16_out.float(), rtol=0, atol=1e-2)


def _train(rank, world, autocast):
    import datetime

    import torch.distributed as dist

    from rrfp.app.config.sections import (
        ComputeSection,
        OptimSection,
        ParallelSection,
        RunSection,
        ScheduleSection,
    )
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        model, data = _gpt()
        cfg = TrainConfig(
            RunSection(steps=STEPS, seed=0, timeout_s=60),
            ParallelSection(pp=world),
            ScheduleSection(n_microbatches=M),
            OptimSection(lr=LR),
            ComputeSection(autocast=autocast),
            model=model,
            data=data,
        )
        return run(stage_main(cfg)).losses
    finally:
        dist.destroy_process_group()


STEPS, LR = 3, 3e-2  # a large step: bfloat16 shows in the losses after one update


def _gpt():
    from rrfp.models.data import DataConfig
    from rrfp.models.gpt import GPTConfig

    return (
        GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32),
        DataConfig(seed=1, microbatch_size=2, min_seq_len=8, max_seq_len=24),
    )


def _one_process_losses(bf16: bool) -> list[float]:
    """``rrfp train``'s update in one process: AdamW on float32 parameters, iteration autocast."""
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT
    from rrfp.models.gpt import loss_fn as gpt_loss

    model_cfg, data_cfg = _gpt()
    torch.manual_seed(0)
    model = GPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        with torch.autocast("cpu", BF16, enabled=bf16):
            loss = sum(gpt_loss(model(x), y) for x, y in make_batches(data_cfg, step, M)) / M
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return losses


@pytest.mark.timeout(150)
def test_train_autocast_matches_one_process_bfloat16():
    losses = run_ranks(_train, 2, "bfloat16", timeout=120)[0]
    want, far = _one_process_losses(bf16=True), _one_process_losses(bf16=False)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    apart = max(abs(a - b) / abs(b) for a, b in zip(losses, far))
    assert worst < CLOSE, (
        f"rrfp train under compute.autocast = bfloat16 {losses} vs one process {want}"
    )
    assert apart > 10 * worst, f"{losses} vs float32 {far}: autocast made no measurable difference"
