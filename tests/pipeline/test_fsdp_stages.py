"""FSDP2 (``fully_shard``) stage modules and rrfp's own DP under ready dispatch, on pp 2 x dp 2
(4 gloo ranks; stage s of replica d on rank s * 2 + d), through PipelineRuntime.stage_executor:
after 2 AdamW steps every rank's gradients and parameters equal one process's over the whole
batch of both replicas (float64), for the hints bfw, zbh1 and plan, and with two stages per rank
(v, FSDP, bfw). Under those hints the replicas draw their emulated task durations from different
seeds, so they may run their tasks in different orders, as load decides. The runs in UNEQUAL make
the replicas' first stages run different orders by construction, under fixed and under ready
dispatch, and the test checks that they did (why different orders are safe:
rrfp/pipeline/sharded_stages.py)."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks, started_waits, timed_iteration, timed_outcome
from harness.fsdp_parity import LR, ROWS, STEPS, M, batch, full, loss_fn, model, reference, shard

pytestmark = pytest.mark.multirank

HINTS = ("bfw", "zbh1", "plan")
# (name, dispatch, split, each replica's hint and budget): replicas whose first stage runs
# different orders by construction. Ready with a budget of one microbatch leaves one task ready at
# a time (F0 B0 F1 B1 ...); ready gpipe with a budget of M always has the next F ready at the
# first stage and ranks it first (F0 ... F3, then the Bs, which come back in order).
UNEQUAL = (
    ("gpipe|1f1b fixed, whole backward", "fixed", False, ("gpipe", "1f1b"), ("2x", "2x")),
    ("gpipe|zbh1 fixed, split backward", "fixed", True, ("gpipe", "zbh1"), ("2x", "2x")),
    ("1f1b@1|gpipe@M ready, whole backward", "ready", False, ("1f1b", "gpipe"), (1, M)),
)
# the first stage's order on each replica of the ready UNEQUAL run, as it must be
FIRST_STAGE_ORDERS = (
    [f"{t}{m}@0" for m in range(M) for t in "FB"],
    [f"F{m}@0" for m in range(M)] + [f"B{m}@0" for m in range(M)],
)
# (layout, hint or UNEQUAL name, stages per rank): V = 2 places stages v (rank r: r and 3 - r), so
# each rank's two local stages finish their last W in an order readiness picks
RUNS = (
    [(k, h, 1) for k in ("dp_shard", "dp") for h in HINTS]
    + [("dp_shard", u[0], 1) for u in UNEQUAL]
    + [("dp_shard", "bfw", 2)]
)


async def _steps(rt, modules, ex, sync_dp: bool):
    """STEPS AdamW steps of ``ex`` on this replica's half of each batch: (gradients of the last
    step, parameters after it, the orders the rank ran, the last stage's losses), names as in the
    whole model."""
    import torch

    d = rt.dp_rank
    held = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
    sync = rt.grad_sync(held, ex) if sync_dp else None
    opt = torch.optim.AdamW(held.parameters(), lr=LR)
    named = [(f"{s}.{n}", p) for s, m in zip(rt.stages, modules) for n, p in m.named_parameters()]
    orders, losses = [], []
    for step in range(STEPS):
        x, y = batch(step)
        half = slice(d * ROWS // 2, (d + 1) * ROWS // 2)
        mbs = list(zip(x[half].chunk(M), y[half].chunk(M)))
        opt.zero_grad()
        res = await ex.run_iteration(step, mbs)
        if sync is not None:
            await sync.sync()
        orders.append([f"{t}@{s}" for s, t in res.ran])
        losses.append([res.losses[mb] for mb in range(M)] if res.losses else [])
        opt.step()
    # the last step's gradients (gathered once: a shard's full_tensor is a collective), which the
    # optimizer step leaves as they are
    grads = {n: full(p.grad) for n, p in named}
    return grads, {n: full(p) for n, p in named}, orders, losses


def _rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from rrfp.core.variability import Variability
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))["dp_shard"]

    async def one(rt, kind: str, name: str):
        """STEPS steps of one run: (gradients of the last step, parameters after it, the orders the
        rank ran, the last stage's losses), names as in the whole model."""
        d, full_model = rt.dp_rank, model(rt.num_stages)
        modules = [full_model[s] for s in rt.stages]
        if kind == "dp_shard":
            modules = [shard(m, mesh) for m in modules]
        unequal = {u[0]: u[1:] for u in UNEQUAL}.get(name)
        if unequal is None:  # ready, each replica its own durations
            how = dict(
                hint=name, variability=Variability.preset("jitter", jitter=0.8), seed=11 * d + 1
            )
        else:
            dispatch, split, hints, budgets = unequal
            how = dict(hint=hints[d], dispatch=dispatch, split=split, budget=budgets[d])
        ex = rt.stage_executor(modules, loss_fn, n_microbatches=M, **how)
        return await _steps(rt, modules, ex, sync_dp=kind == "dp")

    async def main():
        out = {}
        for virtual in (1, 2):
            rt = PipelineRuntime.start(
                pp=2,
                dp=2,
                timeout_s=60,
                unit_ms=3.0,
                virtual=virtual,
                placement="v" if virtual == 2 else "interleaved",
            )
            try:
                for kind, name, v in RUNS:
                    if v == virtual:
                        out[(kind, name, v)] = await one(rt, kind, name)
            finally:
                await rt.aclose()
        return divmod(rank, 2), out

    return run(main())


def _check_run(where: str, got, want, d: int, holds_last: bool) -> None:
    """One run of one rank against the one-process reference: its last step's gradients, its
    parameters after the steps and, on the last stage, its losses."""
    import torch

    got_grads, got_params, _, got_losses = got
    grads, params, losses = want
    assert got_grads, where
    for name, grad in got_grads.items():
        for what, value, expected in (("grad", grad, grads), ("param", got_params[name], params)):
            torch.testing.assert_close(
                torch.tensor(value, dtype=torch.float64),
                expected[name],
                rtol=1e-10,
                atol=1e-12,
                msg=f"{where} {name} {what}",
            )
    assert bool(got_losses[0]) == holds_last, where
    if holds_last:
        for step in range(STEPS):
            assert got_losses[step] == pytest.approx(
                losses[step][d * M : (d + 1) * M], rel=1e-10
            ), (where, step)


@pytest.mark.timeout(200)
def test_fsdp_and_dp_stages_equal_one_process_when_replicas_run_different_orders():
    results = run_ranks(_rank, 4, timeout=180)
    want = {v: reference(2 * v) for v in (1, 2)}
    diverged = set()
    for rank, ((pp_rank, d), out) in results.items():
        assert sorted(out) == sorted(RUNS), (rank, list(out))
        for run, got in out.items():
            _check_run(
                f"rank {rank} {run}", got, want[run[2]], d, pp_rank == (0 if run[2] == 2 else 1)
            )
            orders = got[2]
            if orders != results[pp_rank * 2 + 1 - d][1][run][2]:
                diverged.add(run)
            if run[1] == UNEQUAL[2][0] and pp_rank == 0:
                assert orders == [FIRST_STAGE_ORDERS[d]] * STEPS, (rank, orders)
    # the replicas ran different orders where their construction says they must; under the ready
    # hints they may or may not, as load decides, and the results are equal either way
    assert {("dp_shard", u[0], 1) for u in UNEQUAL} <= diverged, diverged


# (dispatch, hint, unsplit stages): FSDP stages of a split schedule, one of them run whole
UNSPLIT = (("ready", "bfw", (-1,)), ("fixed", "zbh1", (0,)))


def _unsplit_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))["dp_shard"]

    async def main():
        out = {}
        # real compute: emulated time draws a split W for every stage and refuses unsplit ones
        async with PipelineRuntime.start(pp=2, dp=2, timeout_s=60) as rt:
            for dispatch, hint, unsplit in UNSPLIT:
                modules = [shard(model(rt.num_stages)[s], mesh) for s in rt.stages]
                settings = ScheduleSettings.of(
                    M, dispatch=dispatch, hint=hint, unsplit_stages=unsplit
                )
                ex = rt.stage_executor(modules, loss_fn, settings=settings)
                got = await _steps(rt, modules, ex, sync_dp=False)
                out[(dispatch, hint, unsplit)] = (got, [w.whole for w in ex.workers])
        return divmod(rank, 2), out

    return run(main())


@pytest.mark.timeout(200)
def test_fsdp_stages_left_unsplit_equal_one_process():
    """An FSDP stage whose B runs its whole backward accumulates on the unsharded parameters as
    W would, and the one reduce-scatter after the iteration gives one process's gradients."""
    from rrfp.pipeline.schedule_settings import unsplit_stages_of

    results = run_ranks(_unsplit_rank, 4, timeout=180)
    want = reference(2)
    for rank, ((pp_rank, d), out) in results.items():
        assert sorted(out) == sorted(UNSPLIT), (rank, list(out))
        for run, (got, whole) in out.items():
            assert whole == [pp_rank in unsplit_stages_of(run[2], 2)], (rank, run)
            _check_run(f"rank {rank} {run}", got, want, d, pp_rank == 1)


def _replica_stuck(rank, world, progress_s):
    """pp 1 x dp_shard 2: replica 1 stays in the runtime, beating, and never starts the iteration;
    replica 0 waits in FSDP's all-gather on the lane's thread."""

    import torch

    import rrfp
    from rrfp.pipeline.sharded_stages import shard_stage

    async def main(mark):
        waits = started_waits(2.0, progress_s=progress_s)  # start-up is no part of the row
        async with rrfp.PipelineRuntime.start(pp=1, dp=2, timeout_s=2.0, timeouts=waits) as rt:
            torch.manual_seed(0)
            module = shard_stage(torch.nn.Linear(8, 8), rt.dp_group, "cpu")
            ex = rt.stage_executor(module, lambda y, t: ((y - t) ** 2).mean(), n_microbatches=2)
            if rank == 1:
                await asyncio.sleep(3 * progress_s)
                return
            await timed_iteration(ex, mark)

    import asyncio

    return timed_outcome(main)


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_replica_that_never_reaches_fsdps_all_gather_is_named_after_progress_s():
    """FSDP's all-gather runs on the lane's thread, over a group whose own timeout is the one-day
    backstop: the wait is marked as one at a collective, which the runtime's watcher bounds."""
    progress_s = 4.0
    results = run_ranks(_replica_stuck, 2, progress_s, timeout=70)
    error, took = results[0]["error"], results[0]["took"]
    assert error is not None and "PeerStuck" in error and "rank 1" in error, results[0]
    assert "all-gather" in error and progress_s - 0.5 <= took <= progress_s + 5, results[0]
    print(f"rank 0 after {took:.1f} s: {error}")
