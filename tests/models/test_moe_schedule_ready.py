"""The Llama family's mixture of experts through ``ScheduleReady`` (torch's PipelineStage, the
script's own optimizer and bias update) on pp 2 x dp 2 gloo ranks, float64, 3 AdamW steps with
the auxiliary loss and the bias update on: losses, parameters and expert biases equal one process
training the whole model on the whole batch of both replicas."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks
from harness.moe_schedule_ready import M, config, module_state, reference_of, train_replica

pytestmark = pytest.mark.multirank

MORE = dict(moe_shared_intermediate_size=8, moe_score_func="sigmoid")


def _rank(rank, world, hint):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady
    from rrfp.models.llama import Llama, loss_fn

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    pipes = {d: dist.new_group([d, 2 + d]) for d in (0, 1)}  # every rank makes every group
    replicas = {s: dist.new_group([2 * s, 2 * s + 1]) for s in (0, 1)}
    s, d = divmod(rank, 2)
    torch.manual_seed(0)
    module = Llama(config(**MORE), s, 2)
    stage = PipelineStage(module, s, 2, torch.device("cpu"), group=pipes[d])
    try:
        with ScheduleReady(
            stage, M, loss_fn=loss_fn, timeout_s=60, dp_sync=True, hint=hint
        ) as schedule:
            losses = train_replica(schedule, module, s, d, replicas[s])
        return s, {n: t.numpy() for n, t in module_state(module).items()}, losses
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hint", ["bfw", "zbh1"])
def test_schedule_ready_moe_equals_one_process(hint):
    import torch

    want, want_losses = reference_of(**MORE)
    assert any(t.abs().max() > 0 for n, t in want.items() if n.endswith("expert_bias"))
    seen = set()
    for rank, (s, state, losses) in run_ranks(_rank, 4, hint, timeout=180).items():
        for n, v in state.items():
            torch.testing.assert_close(
                torch.from_numpy(v), want[n], rtol=1e-11, atol=1e-13, msg=f"rank {rank} {n}"
            )
        seen |= set(state)
        if s == 1:
            d = rank - 2
            for step, got in enumerate(losses):
                assert got == pytest.approx(want_losses[step][d * M : (d + 1) * M], abs=1e-12)
    assert seen == set(want)
