"""FSDP2 (``fully_shard``) stage modules and rrfp's own DP under ready dispatch, on pp 2 x dp 2
(4 gloo ranks; stage s of replica d on rank s * 2 + d), through PipelineRuntime.stage_executor:
after 3 AdamW steps every rank's gradients and parameters equal one process's over the whole
batch of both replicas (float64), for the hints bfw, zbh1 and plan. The replicas draw their
emulated task durations from different seeds, so they run their stages' tasks in different
orders; the test checks that they did under bfw and plan (why that is safe:
rrfp/pipeline/sharded_stages.py)."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from fsdp_parity import LR, ROWS, STEPS, M, batch, full, loss_fn, model, reference, shard

pytestmark = pytest.mark.multirank

HINTS = ("bfw", "zbh1", "plan")
# (name, dispatch, split, each replica's hint): replicas that run different orders by construction
UNEQUAL = (
    ("gpipe|1f1b fixed, whole backward", "fixed", False, ("gpipe", "1f1b")),
    ("gpipe|zbh1 fixed, split backward", "fixed", True, ("gpipe", "zbh1")),
)
RUNS = [(k, h) for k in ("dp_shard", "dp") for h in HINTS] + [("dp_shard", u[0]) for u in UNEQUAL]


def _rank(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from rrfp.core.variability import Variability
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        rt = PipelineRuntime.start(pp=2, dp=2, timeout_s=60, unit_ms=3.0)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        s, d = rt.stage, rt.dp_rank
        out = {}
        try:
            for kind, name in RUNS:
                module = model()[s]
                if kind == "dp_shard":
                    module = shard(module, mesh["dp_shard"])
                unequal = {u[0]: u[1:] for u in UNEQUAL}.get(name)
                if unequal is None:  # ready, each replica its own durations
                    how = dict(
                        hint=name,
                        variability=Variability.preset("jitter", jitter=0.8),
                        seed=11 * d + 1,
                    )
                else:
                    dispatch, split, hints = unequal
                    how = dict(hint=hints[d], dispatch=dispatch, split=split)
                ex = rt.stage_executor(module, loss_fn, microbatches=M, **how)
                sync = rt.grad_sync(module, ex) if kind == "dp" else None
                opt = torch.optim.AdamW(module.parameters(), lr=LR)
                orders, losses = [], []
                for step in range(STEPS):
                    x, y = batch(step)
                    half = slice(d * ROWS // 2, (d + 1) * ROWS // 2)
                    mbs = list(zip(x[half].chunk(M), y[half].chunk(M)))
                    opt.zero_grad()
                    res = await ex.run_iteration(step, mbs)
                    if sync is not None:
                        await sync.sync()
                    orders.append([str(t) for t in res.order])
                    losses.append([res.losses[mb] for mb in range(M)] if s == 1 else [])
                    grads = {n: full(p.grad) for n, p in module.named_parameters()}
                    opt.step()
                params = {n: full(p) for n, p in module.named_parameters()}
                out[(kind, name)] = (grads, params, orders, losses)
        finally:
            await rt.aclose()
        return s, d, out

    return run(main())


@pytest.mark.timeout(200)
def test_fsdp_and_dp_stages_equal_one_process_when_replicas_run_different_orders():
    import torch

    results = run_ranks(_rank, 4, timeout=180)
    grads, params, losses = reference()
    diverged = set()
    for rank, (s, d, out) in results.items():
        assert sorted(out) == sorted(RUNS), (rank, list(out))
        for run, (got_grads, got_params, orders, got_losses) in out.items():
            for name, want in grads.items():
                stage, local = name.split(".", 1)
                if int(stage) != s:
                    continue
                where = f"rank {rank} {run} {local}"
                torch.testing.assert_close(
                    torch.tensor(got_grads[local], dtype=torch.float64),
                    want,
                    rtol=1e-10,
                    atol=1e-12,
                    msg=f"{where} grad",
                )
                torch.testing.assert_close(
                    torch.tensor(got_params[local], dtype=torch.float64),
                    params[name],
                    rtol=1e-10,
                    atol=1e-12,
                    msg=f"{where} param",
                )
            if s == 1:
                for step in range(STEPS):
                    assert got_losses[step] == pytest.approx(
                        losses[step][d * M : (d + 1) * M], rel=1e-10
                    ), (where, step)
            other = results[s * 2 + 1 - d][2][run][2]
            if orders != other:
                diverged.add(run)
    # the replicas really did run different orders: under bfw and plan (a plan each), and where
    # each has its own hint; zbh1 ranks a stage's tasks so strictly that its replicas may agree
    want = {(k, h) for k in ("dp_shard", "dp") for h in ("bfw", "plan")}
    assert want | {("dp_shard", u[0]) for u in UNEQUAL} <= diverged, diverged
