"""ScheduleReady(mesh=) in a pp 2 x dp 2 DeviceMesh (4 gloo ranks), and torch's Schedule1F1B on
the same FSDP2 stages: after 2 AdamW steps every rank's gradients, parameters and losses equal
one process's over the whole batch of both replicas (float64), and so do the losses of an eval
after them (forward only, FSDP's own all-gathers in one fixed order). Under ("pp", "dp_shard")
the stage modules are fully_shard'ed over the replicas; under ("pp", "dp") ScheduleReady averages
the gradients itself, from the mesh alone (no dp_sync=)."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks
from harness.fsdp_parity import LR, ROWS, STEPS, M, batch, full, loss_fn, model, reference, shard

pytestmark = pytest.mark.multirank

RUNS = (  # (mesh's dp dimension, schedule)
    ("dp_shard", "bfw"),
    ("dp_shard", "zbh1"),
    ("dp_shard", "torch 1f1b"),
    ("dp", "bfw"),
    ("dp", "zbh1"),
)


def _rank(rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from rrfp import ScheduleReady

    dist.init_process_group("gloo")
    meshes = {
        dim: init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dim))
        for dim in ("dp_shard", "dp")
    }
    s, d = divmod(rank, 2)
    out = {}
    try:
        for dim, schedule_name in RUNS:
            mesh = meshes[dim]
            module = model()[s]
            if dim == "dp_shard":
                module = shard(module, mesh["dp_shard"])
            stage = PipelineStage(module, s, 2, torch.device("cpu"), group=mesh["pp"].get_group())
            if schedule_name == "torch 1f1b":
                schedule = Schedule1F1B(stage, M, loss_fn=loss_fn)
            else:
                schedule = ScheduleReady(stage, M, loss_fn=loss_fn, hint=schedule_name, mesh=mesh)
            opt = torch.optim.AdamW(module.parameters(), lr=LR)
            losses = []
            try:
                for step in range(STEPS):
                    x, y = batch(step)
                    half = slice(d * ROWS // 2, (d + 1) * ROWS // 2)
                    opt.zero_grad()
                    step_losses = []
                    if s == 0:
                        schedule.step(x[half])
                    else:
                        schedule.step(target=y[half], losses=step_losses)
                    losses.append([t.item() for t in step_losses])
                    grads = {n: full(p.grad) for n, p in module.named_parameters()}
                    opt.step()
                x, y = batch(STEPS)  # forward only, after the last step: the losses
                half = slice(d * ROWS // 2, (d + 1) * ROWS // 2)
                eval_losses = []
                if s == 0:
                    schedule.eval(x[half])
                else:
                    schedule.eval(target=y[half], losses=eval_losses)
                losses.append([t.item() for t in eval_losses])
            finally:
                if isinstance(schedule, ScheduleReady):
                    schedule.close()
            params = {n: full(p) for n, p in module.named_parameters()}
            out[(dim, schedule_name)] = (grads, params, losses)
    finally:
        dist.destroy_process_group()
    return s, d, out


@pytest.mark.timeout(200)
def test_schedule_ready_in_a_mesh_and_torch_1f1b_on_fsdp_stages_equal_one_process():
    import torch

    results = run_ranks(_rank, 4, timeout=180)
    grads, params, losses = reference()
    ref = model()
    ref.load_state_dict(params)
    with torch.no_grad():
        x, y = batch(STEPS)
        losses.append([loss_fn(ref(a), b).item() for a, b in zip(x.chunk(2 * M), y.chunk(2 * M))])
    for rank, (s, d, out) in results.items():
        assert sorted(out) == sorted(RUNS), (rank, list(out))
        for run, (got_grads, got_params, got_losses) in out.items():
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
                for step in range(STEPS + 1):  # the last: eval's
                    assert got_losses[step] == pytest.approx(
                        losses[step][d * M : (d + 1) * M], rel=1e-10
                    ), (rank, run, step)
