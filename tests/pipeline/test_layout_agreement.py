"""Ranks whose executors were given different microbatch counts are refused before their first
iteration, in one line on every rank that names both counts and the ranks, through either API:
not a deadlock after timeouts.progress_s, nor a bare cancellation."""

from __future__ import annotations

import time

import pytest
import torch
from harness.distributed import run_ranks, started_waits

from rrfp.pipeline.layout_agreement import ExecutorShape, disagreement

pytestmark = pytest.mark.multirank

WIDTH, BATCH = 4, 8
PROGRESS_S = 60.0  # the deadlock's bound: the refusal comes long before it


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _runtime_rank(rank, world):
    import rrfp

    M = 4 if rank == 0 else 2
    torch.manual_seed(rank)
    module = torch.nn.Linear(WIDTH, WIDTH)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    async def main():
        waits = started_waits(2.0, progress_s=PROGRESS_S)
        async with rrfp.PipelineRuntime.start(pp=world, timeout_s=2.0, timeouts=waits) as rt:
            ex = rt.stage_executor(module, _loss, n_microbatches=M)
            await ex.run_iteration(0, list(zip(x.chunk(M), y.chunk(M))))

    began = time.monotonic()
    try:
        rrfp.run(main())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "took": time.monotonic() - began}
    return {}


def _schedule_rank(rank, world):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp.pipelining.schedule import ScheduleReady

    dist.init_process_group("gloo")
    M = 4 if rank == 0 else 2
    torch.manual_seed(rank)
    stage = PipelineStage(torch.nn.Linear(WIDTH, WIDTH), rank, world, torch.device("cpu"))
    waits = started_waits(2.0, progress_s=PROGRESS_S)
    began = time.monotonic()
    try:
        schedule = ScheduleReady(stage, M, loss_fn=_loss, timeouts=waits)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "took": time.monotonic() - began}
    return {}


@pytest.mark.parametrize("api", [_runtime_rank, _schedule_rank], ids=["runtime", "schedule"])
def test_microbatch_counts_that_differ_are_refused_in_one_line(api):
    got = run_ranks(api, 2, timeout=60)
    for rank in (0, 1):
        error = got[rank].get("error")
        assert error is not None, got
        assert error.startswith(f"LayoutMismatch: rank {rank}: the ranks disagree on the "), error
        assert "microbatch count (4 on rank 0; 2 on rank 1)" in error, error
        assert "\n" not in error and got[rank]["took"] < PROGRESS_S, got


@pytest.mark.unit
def test_the_line_names_each_value_with_its_ranks():
    shapes = [ExecutorShape(4, 2), ExecutorShape(4, 2), ExecutorShape(8, 3)]
    line = disagreement(1, shapes)
    assert "microbatch count (4 on ranks 0, 1; 8 on rank 2)" in line, line
    assert disagreement(0, shapes[:2]) is None
    v2, v1 = ExecutorShape(4, 2, "1 x 2 (v)"), ExecutorShape(4, 2, "1 x 2 (interleaved)")
    assert "stage layout (1 x 2 (v) on rank 0; 1 x 2 (interleaved) on rank 1)" in disagreement(
        0, [v2, v1]
    )
    assert "number of stages (2 on rank 0; 3 on rank 1)" in disagreement(
        0, [shapes[0], ExecutorShape(4, 3)]
    )
