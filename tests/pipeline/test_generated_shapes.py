"""The runtime on real gloo ranks over generated shapes, against one process.

tests/pipeline/test_pipeline.py and tests/pipeline/test_virtual_pipeline.py check the shapes our
models have (M = 4, default budgets). Users bring others: one stage per rank or V = 2 and 3, a
handful of microbatches of different sizes, budgets far below what the pipeline needs, count and
byte budgets, split and whole backwards, every hint with a form on the layout, ready and fixed
dispatch. The shapes are drawn from a seeded generator (one process group runs them all; hypothesis
cannot drive examples across processes): set ``RRFP_SHAPES_SEED`` to draw others. Each shape is one
iteration; every stage's gradients and the loss must equal one process within float64 rounding,
every task must run once, and nothing may hang."""

from __future__ import annotations

import os
import random

import pytest
import torch
from harness.distributed import run_ranks
from harness.virtual_model import D, build
from torch import nn

pytestmark = pytest.mark.multirank

SEED = int(os.environ.get("RRFP_SHAPES_SEED", "19"))
HINTS = (
    "bfw",
    "bf",
    "plan",
    "gpipe",
    "1f1b",
    "zbh1",
    "zbv",
)  # taken in turn: every one runs in every run
BUDGETS = ("0.25x", "0.5x", "1x", "2x", "1", "2", "3", "200B", "600B", "2KiB")


def shapes(world: int, n: int, seed: int) -> list[dict]:
    """``n`` shapes that have a form on their layout (zbv only on v, zbh1 only at V = 1, 1f1b's
    rounds dividing M, ...)."""
    from rrfp.core.hints import default_split, resolve
    from rrfp.core.placement import VirtualLayout
    from rrfp.sim.sweep import applies

    rng, out = random.Random(seed), []
    while len(out) < n:
        hint = HINTS[len(out) % len(HINTS)]
        placement = rng.choice(["interleaved", "v"])
        V = 2 if placement == "v" else rng.choice([1, 2, 3])
        M = rng.randint(1, 7)
        split = rng.choice([None, True, False])
        if (
            applies(
                resolve(hint), VirtualLayout(world, V, placement), M, default_split(hint, split)
            )
            is not None
        ):
            continue  # drawn again for the same hint
        out.append(
            dict(
                placement=placement,
                V=V,
                M=M,
                hint=hint,
                split=split,
                dispatch=rng.choice(["ready", "fixed"]),
                budget=rng.choice(BUDGETS),
                sizes=[rng.randint(1, 3) for _ in range(M)],
                data=rng.randrange(1 << 30),
            )
        )
    return out


def batches(shape: dict):
    g = torch.Generator().manual_seed(shape["data"])
    return [
        (
            torch.randn(b, D, generator=g, dtype=torch.float64),
            torch.randn(b, 2, generator=g, dtype=torch.float64),
        )
        for b in shape["sizes"]
    ]


def reference(shape: dict, num_stages: int, stages: tuple[int, ...]):
    full = build(num_stages)
    mbs = batches(shape)
    loss = sum(nn.functional.mse_loss(full(x), y) for x, y in mbs) / len(mbs)
    loss.backward()
    return loss.item(), {
        s: {n: p.grad.clone() for n, p in full[s].named_parameters()} for s in stages
    }


def _ranks(rank, world, todo):
    import asyncio
    import datetime
    import itertools

    import torch.distributed as dist

    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))

    async def main():
        out = []
        by_layout = itertools.groupby(
            sorted(enumerate(todo), key=lambda e: (e[1]["placement"], e[1]["V"])),
            key=lambda e: (e[1]["placement"], e[1]["V"]),
        )
        for (placement, V), group in by_layout:
            async with PipelineRuntime.start(
                pp=world, timeout_s=60, virtual=V, placement=placement
            ) as rt:
                for i, shape in group:
                    want_loss, want = reference(shape, rt.num_stages, rt.stages)
                    full = build(rt.num_stages)
                    modules = [full[s] for s in rt.stages]
                    ex = rt.stage_executor(
                        modules,
                        nn.functional.mse_loss,
                        n_microbatches=shape["M"],
                        dispatch=shape["dispatch"],
                        hint=shape["hint"],
                        budget=shape["budget"],
                        split=shape["split"],
                    )
                    res = await ex.run_iteration(0, batches(shape))
                    err = max(
                        (p.grad - want[s][n]).abs().max().item()
                        for s, c in zip(rt.stages, modules)
                        for n, p in c.named_parameters()
                    )
                    out.append(
                        (
                            i,
                            rt.stages,
                            err,
                            sorted((s, str(t)) for s, t in res.ran),
                            None if res.loss is None else abs(res.loss - want_loss),
                            ex.settings.split,
                        )
                    )
        dist.destroy_process_group()
        return out

    return asyncio.run(main())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,n", [(2, 16), (3, 8)])
def test_generated_shapes_match_one_process(world, n):
    from rrfp.core.hints import default_split

    todo = shapes(world, n, SEED + world)
    assert {s["hint"] for s in todo} == set(HINTS)
    results = run_ranks(_ranks, world, todo, timeout=240)
    for rank, out in sorted(results.items()):
        assert sorted(i for i, *_ in out) == list(range(n)), rank
        for i, stages, err, ran, loss_err, split in out:
            shape = todo[i]
            where = (rank, stages, shape)
            assert err < 1e-12, where
            assert split == default_split(shape["hint"], shape["split"]), (
                where
            )  # the executor took the split
            kinds = "FBW" if split else "FB"
            assert ran == sorted(
                (s, f"{k}{m}") for s in stages for k in kinds for m in range(shape["M"])
            ), where
            last = world * shape["V"] - 1
            assert (loss_err is not None) == (last in stages), where
            assert loss_err is None or loss_err < 1e-12, where
