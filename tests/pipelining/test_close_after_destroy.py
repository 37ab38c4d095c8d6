"""``ScheduleReady.close()`` after the script took the process group down itself
(``dist.destroy_process_group()`` first) closes without the final barrier it can no longer run,
where it raised a KeyError from torch's group table; a second ``close()`` does nothing."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank


def _step_destroy_close(rank, world):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp.pipelining.schedule import ScheduleReady

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))
    schedule = ScheduleReady(stage, 2, loss_fn=lambda o, y: ((o - y) ** 2).mean(), timeout_s=10)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    losses: list = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    dist.destroy_process_group()
    schedule.close()
    schedule.close()
    return len(losses)


@pytest.mark.timeout(120)
def test_close_after_destroy_process_group_closes_without_an_error():
    assert run_ranks(_step_destroy_close, 2, timeout=90) == {0: 0, 1: 2}
