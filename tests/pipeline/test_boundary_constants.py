"""Constants between stages stay constants: a stage that sends (h, cos, sin, float mask) with only h
requiring grad has the next stage receive cos, sin and the mask without requires_grad, compute no
gradient for them and send None in their slots of the B message; gradients equal one process
(float64). Over real gloo at V = 1, and at V = 2 (v placement) across the V turn on rank 1; and
ScheduleReady's forward-only path keeps the same bits, over messages and its V turn hand-off."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

C, T, M = 4, 5, 3


class Embed(nn.Module):
    """h from the input; rotary-like cos/sin from positions; an additive mask: no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * torch.linspace(
            0.1, 1.0, C, dtype=x.dtype
        )
        mask = torch.where(x[..., 0] > 0, 0.0, -1.0).to(x.dtype)
        return self.lin(x), pos.cos(), pos.sin(), mask


class Block(nn.Module):
    """Uses the constants and passes them on; records which of its inputs required grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.seen: list[tuple[bool, ...]] = []

    def forward(self, inputs):
        h, cos, sin, mask = inputs
        self.seen.append(tuple(t.requires_grad for t in inputs))
        return torch.tanh(self.lin(h) * cos + sin) + mask[..., None], cos, sin, mask


class Head(Block):
    def forward(self, inputs):
        h, cos, sin, mask = inputs
        self.seen.append(tuple(t.requires_grad for t in inputs))
        return self.lin(h * cos + sin) + mask[..., None]


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def chunks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed(), Block(), Block(), Head()]


def batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2, T, C, generator=g), torch.randn(2, T, C, generator=g)) for _ in range(M)
    ]


def reference() -> dict:
    """One process, plain autograd: every chunk's gradients (chunk index, name)."""
    model = nn.Sequential(*chunks())
    loss = sum(loss_fn(model(x), y) for x, y in batches()) / M
    loss.backward()
    return {(i, n): p.grad for i, m in enumerate(model) for n, p in m.named_parameters()}


def _ranks(rank, world):
    from rrfp.core.tasks import Kind
    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    ref = reference()
    out = {}

    async def one(virtual: int, hint: str):
        rt = PipelineRuntime.start(
            pp=world, timeout_s=60, virtual=virtual, placement="v" if virtual > 1 else "interleaved"
        )
        try:
            every = chunks()
            # V = 1: stage 0 is chunks 0-1, stage 1 chunks 2-3; V = 2 (v): rank 0 holds 0 and 3,
            # rank 1 holds 1 and 2
            owned = {0: [0, 1], 1: [2, 3]} if virtual == 1 else {s: [s] for s in range(4)}
            modules = [nn.Sequential(*(every[c] for c in owned[s])) for s in rt.stages]
            ex = rt.stage_executor(
                modules if virtual > 1 else modules[0], loss_fn, n_microbatches=M, hint=hint
            )
            sent_b, produced_b = [], []
            for s in rt.stages:
                ch = rt.channels.of(s).bwd_out
                if ch is not None:
                    # every message a channel sends goes through its post (send awaits it)
                    def record(msg, *args, post=ch.post, **kwargs):
                        assert msg.kind == int(Kind.B)
                        sent_b.append(tuple(t is None for t in msg.tensors))
                        return post(msg, *args, **kwargs)

                    ch.post = record
            for w in ex.workers:

                def backward(mb, grad=None, inner=w.backward):
                    grad_in = inner(mb, grad)
                    if isinstance(grad_in, tuple):
                        produced_b.append(tuple(t is None for t in grad_in))
                    return grad_in

                w.backward = backward
            await ex.run_iteration(0, batches())
            err = max(
                (p.grad - ref[(c, n)]).abs().max().item()
                for s, m in zip(rt.stages, modules)
                for c, n, p in (
                    (owned[s][int(k.split(".")[0])], k.split(".", 1)[1], p)
                    for k, p in m.named_parameters()
                )
            )
            seen = {c: every[c].seen for s in rt.stages for c in owned[s] if c > 0}
            out[virtual] = dict(
                err=err, seen=seen, sent_b=sent_b, produced_b=produced_b, stages=tuple(rt.stages)
            )
        finally:
            await rt.aclose()

    import asyncio

    async def main():
        await one(1, "1f1b")
        await one(2, "bfw")

    asyncio.run(main())
    return out


@pytest.mark.timeout(120)
def test_constants_arrive_as_constants_and_get_no_gradient():
    results = run_ranks(_ranks, 2, timeout=100)
    constant = (True, False, False, False)  # (h, cos, sin, mask): only h requires grad
    no_grad_for_constants = (False, True, True, True)
    for rank, by_virtual in results.items():
        for virtual, r in by_virtual.items():
            where = f"rank {rank}, V = {virtual}"
            assert r["err"] < 1e-12, f"{where}: gradients differ from one process by {r['err']}"
            for chunk, seen in r["seen"].items():
                assert seen and all(s == constant for s in seen), (
                    f"{where}, chunk {chunk} saw {seen}"
                )
            # a B message goes out from every stage but stage 0 (and none across the V turn, stage 2
            # to 1)
            expected_msgs = {(1, 0): 0, (1, 1): M, (2, 0): M, (2, 1): M}[(virtual, rank)]
            assert len(r["sent_b"]) == expected_msgs and all(
                b == no_grad_for_constants for b in r["sent_b"]
            ), f"{where}: B messages {r['sent_b']}"
            # what B hands back, messages and the V turn: every stage but the first
            produced = {(1, 0): 0, (1, 1): M, (2, 0): M, (2, 1): 2 * M}[(virtual, rank)]
            assert len(r["produced_b"]) == produced and all(
                b == no_grad_for_constants for b in r["produced_b"]
            ), f"{where}: B outputs {r['produced_b']}"
    assert results[1][2]["stages"] == (1, 2), "the V turn is between stages 1 and 2 on rank 1"


class Args(nn.Module):
    """A chunk as torch.distributed.pipelining calls a stage: the boundary as separate arguments."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, *inputs):
        return self.chunk(inputs[0] if len(inputs) == 1 else inputs)


def _forward_only(rank, world):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    every = chunks()
    held = {0: (0, 3), 1: (1, 2)}[rank]  # v: the hand-off between stages 1 and 2 is rank 1's V turn
    stages = [PipelineStage(Args(every[s]), s, 4, torch.device("cpu")) for s in held]
    x = torch.cat([b[0] for b in batches()])
    try:
        with ScheduleReady(
            stages, M
        ) as schedule:  # no loss_fn: forward only, here with grad enabled
            schedule.step(*((x,) if 0 in held else ()))
    finally:
        dist.destroy_process_group()
    return {s: every[s].seen for s in held if s > 0}


@pytest.mark.timeout(120)
def test_forward_only_keeps_the_bits_across_messages_and_the_v_turn():
    results = run_ranks(_forward_only, 2, timeout=100)
    seen = {s: v for r in results.values() for s, v in r.items()}
    assert sorted(seen) == [1, 2, 3]
    for s, records in seen.items():
        assert len(records) == M and all(r == (True, False, False, False) for r in records), (
            s,
            records,
        )
