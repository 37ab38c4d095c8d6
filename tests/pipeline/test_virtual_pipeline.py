"""Virtual stages on real gloo ranks against one process: V = 2 stages per rank, both
placements, 2 and 4 ranks. Every stage's gradients after one step, and its parameters after
two AdamW steps, must equal a single-process run of the same model and data (float64), for
ready BFW and the planned hint, and for the fixed baselines as nominal orders: interleaved
1F1B (interleaved placement) and ZB-V (v placement)."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from harness.virtual_model import D, build
from torch import nn

BATCH, M, STEPS, V = 3, 4, 2, 2
CONFIGS = {
    "interleaved": [("ready", "bfw"), ("fixed", "1f1b"), ("fixed", "bfw"), ("ready", "plan")],
    "v": [("ready", "bfw"), ("fixed", "zbv"), ("ready", "zbv"), ("fixed", "plan")],
}


def batches(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [
        (
            torch.randn(BATCH, D, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(M)
    ]


def reference(num_stages: int, stages: tuple[int, ...]):
    """(first-step gradients, parameters after STEPS steps) of ``stages``, in one process."""
    full = build(num_stages)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    grads = None
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(full(x), y) for x, y in batches(step)) / M
        loss.backward()
        if step == 0:
            grads = {s: {n: p.grad.clone() for n, p in full[s].named_parameters()} for s in stages}
        opt.step()
    return grads, {
        s: {n: p.detach().clone() for n, p in full[s].named_parameters()} for s in stages
    }


def _ranks(rank, world):
    import asyncio
    import datetime

    import torch.distributed as dist

    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    dist.init_process_group(
        "gloo", timeout=datetime.timedelta(seconds=60)
    )  # both placements' runtimes share it

    async def main():
        out = {}
        for placement, configs in CONFIGS.items():
            async with PipelineRuntime.start(
                pp=world, timeout_s=60, virtual=V, placement=placement
            ) as rt:
                want_grads, want_params = reference(rt.num_stages, rt.stages)
                channels = {c.name: c for c in rt.channels.all()}
                for dispatch, hint in configs:
                    full = build(rt.num_stages)
                    modules = [full[s] for s in rt.stages]
                    opts = [torch.optim.AdamW(c.parameters(), lr=1e-2) for c in modules]
                    ex = rt.stage_executor(
                        modules,
                        nn.functional.mse_loss,
                        n_microbatches=M,
                        dispatch=dispatch,
                        hint=hint,
                    )
                    sent = sum(c.messages for c in channels.values())
                    for step in range(STEPS):
                        for o in opts:
                            o.zero_grad()
                        res = await ex.run_iteration(step, batches(step))
                        if step == 0:
                            grad_err = max(
                                (p.grad - want_grads[s][n]).abs().max().item()
                                for s, c in zip(rt.stages, modules)
                                for n, p in c.named_parameters()
                            )
                            ran = [(s, str(t)) for s, t in res.ran]
                            loss = res.loss
                        for o in opts:
                            o.step()
                    param_err = max(
                        (p.detach() - want_params[s][n]).abs().max().item()
                        for s, c in zip(rt.stages, modules)
                        for n, p in c.named_parameters()
                    )
                    # fixed dispatch runs its order (a plan's is made per iteration: not ex.order)
                    order = (
                        [(s, str(t)) for s, t in ex.order]
                        if dispatch == "fixed" and hint != "plan"
                        else None
                    )
                    messages = (sum(c.messages for c in channels.values()) - sent) // STEPS
                    out[(placement, dispatch, hint)] = (
                        grad_err,
                        param_err,
                        ran,
                        order,
                        loss,
                        rt.stages,
                        sorted(channels),
                        messages,
                    )
        dist.destroy_process_group()
        return out

    return asyncio.run(main())


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_virtual_stages_match_one_process(world):
    results = run_ranks(_ranks, world, timeout=240)
    S = world * V
    for rank, out in sorted(results.items()):
        for (placement, dispatch, hint), (
            grad_err,
            param_err,
            ran,
            order,
            loss,
            stages,
            names,
            messages,
        ) in out.items():
            print(
                f"rank {rank} stages {stages} ({placement}) {dispatch} {hint}: max |grad diff| "
                f"{grad_err:.1e}, "
                f"max |param diff| {param_err:.1e}, {messages} messages per iteration"
            )
            assert grad_err < 1e-12, (rank, placement, dispatch, hint, grad_err)
            assert param_err < 1e-12, (rank, placement, dispatch, hint, param_err)
            split = hint in ("bfw", "zbv", "plan")
            assert len(ran) == V * M * (3 if split else 2)  # every task of both stages, once
            assert {s for s, _ in ran} == set(stages)
            if order is not None:  # fixed dispatch ran exactly its order
                assert ran == order, (rank, placement, hint)
            assert (loss is not None) == (S - 1 in stages)
            # two channels (fwd, bwd; M messages each per iteration) for every boundary to another
            # rank; the V turn (stages world-1 and world on the last rank) has none
            remote = [
                (a, b) for a in stages for b in (a - 1, a + 1) if 0 <= b < S and b not in stages
            ]
            assert len(names) == 2 * len(remote), (rank, placement, names)
            assert messages == 2 * M * len(remote), (rank, placement, messages)
            if placement == "v" and rank == world - 1:
                assert not any(
                    f"{world - 1}->{world} " in n or f"{world}->{world - 1} " in n for n in names
                )


def test_each_forward_of_several_stages_draws_from_its_own_seed():
    """With several stages per rank, how their forwards interleave depends on timing; dropout must
    not: a forward seeded for (iteration, stage, microbatch) draws the same whatever ran before it,
    and leaves the rank's generator where it was (a resumed run found them differing by 9e-5)."""
    from rrfp.pipeline.executor import _seeded

    cpu = torch.device("cpu")
    drop = lambda x: torch.nn.functional.dropout(x, 0.5, True)  # noqa: E731
    x = torch.ones(256)
    first = _seeded(drop, 7, cpu)(x)
    torch.rand(1000)  # another stage's forward ran in between
    state = torch.get_rng_state()
    again = _seeded(drop, 7, cpu)(x)
    assert torch.equal(first, again)
    assert torch.equal(state, torch.get_rng_state()), "the rank's generator is left as it was"
    assert not torch.equal(first, _seeded(drop, 8, cpu)(x)), "another microbatch, another mask"


class ToComplex(nn.Module):
    """Sends a complex tensor on: no link carries one, so the V turn must not either."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.fft.rfft(self.lin(x), dim=-1)


class FromComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, z):
        return self.lin(torch.fft.irfft(z, n=D, dim=-1))


def _complex_turn(rank, world, placement):
    import asyncio

    from rrfp.comm.message import MessageError
    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        async with PipelineRuntime.start(pp=1, timeout_s=30, virtual=V, placement=placement) as rt:
            modules = [ToComplex().double(), FromComplex().double()]
            ex = rt.stage_executor(modules, nn.functional.mse_loss, n_microbatches=M, hint="bfw")
            try:
                await ex.run_iteration(0, batches(0))
            except MessageError as e:
                return str(e), modules[0].lin.weight.grad
            return None, modules[0].lin.weight.grad

    return asyncio.run(main())


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement", ["interleaved", "v"])
def test_the_v_turn_refuses_what_no_link_carries(placement):
    """Two stages of one rank hand tensors over without a message; a complex one used to pass
    and, autograd's leaf being made for floats only, leave the first stage without gradients."""
    error, grad = run_ranks(_complex_turn, 1, placement, timeout=90)[0]
    assert error is not None and "complex128" in error and "do not support" in error, error
    assert grad is None  # refused at F0, before any backward
