"""A one-stage pipeline in one process, built as a library caller builds it (one StageWorker,
one stage's PipelineChannels, no layout), runs the rank path that every V runs: the gradients
are a single-process reference's, the tasks follow the hint, an iteration leaves no reference
cycle that keeps its batches alive."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from rrfp.comm.pipeline_channels import PipelineChannels, RankChannels
from rrfp.core.budget import Budget
from rrfp.core.hints import resolve
from rrfp.core.policy import Dispatch
from rrfp.core.rank_tracker import RankTracker
from rrfp.loop.lane import ComputeLane
from rrfp.pipeline.executor import StageExecutor
from rrfp.pipeline.schedule_settings import ScheduleSettings
from rrfp.pipeline.worker import StageWorker

M = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(M)]


def _loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(y, t)


@pytest.mark.parametrize("dispatch", ["ready", "fixed"])
def test_one_stage_runs_the_rank_path_and_matches_the_reference(dispatch):
    module, batches = _model(), _batches()
    worker = StageWorker(module, 0, 1, M, _loss, split=True)
    settings = ScheduleSettings(
        M, Dispatch.parse(dispatch), resolve("1f1b"), Budget.parse("2x"), True
    )
    lane = ComputeLane()
    ex = StageExecutor(worker, PipelineChannels(0), lane, settings)
    assert isinstance(ex.channels, RankChannels) and ex.channels.of(0).fwd_in is None
    assert isinstance(ex.tracker(ex.spec, lambda mb: 0), RankTracker)
    result = asyncio.run(ex.run_iteration(0, batches))
    lane.close()

    reference = _model()
    for x, t in batches:
        (_loss(reference(x), t) / M).backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    assert len(result.losses) == M
    assert result.ran == [(0, t) for t in result.order]
    if dispatch == "fixed":
        assert [t for _, t in ex.order] == result.order


@pytest.mark.parametrize("budget", ["2x", "64KiB"])  # a byte budget sizes microbatches as it goes
def test_an_iteration_leaves_no_cycle_holding_its_batches(budget):
    """With the cyclic GC off, what ``run_iteration`` got is freed once the caller drops it: no
    reference cycle of the iteration (tracker, size function, tasks) keeps the batches alive."""
    import gc
    import weakref

    worker = StageWorker(_model(), 0, 1, M, _loss, split=True, measure_activations=True)
    settings = ScheduleSettings(M, Dispatch.READY, resolve("bfw"), Budget.parse(budget), True)
    lane = ComputeLane()
    ex = StageExecutor(worker, PipelineChannels(0), lane, settings)
    asyncio.run(ex.run_iteration(0, _batches()))  # what lives across iterations is built
    gc.collect()
    gc.disable()
    try:
        whole = torch.randn(2 * M, 9)  # the microbatches are views of one batch, as torch splits
        batches = [(whole[2 * i : 2 * i + 2, :6], whole[2 * i : 2 * i + 2, 6:]) for i in range(M)]
        alive = weakref.ref(whole)
        del whole
        result = asyncio.run(ex.run_iteration(1, batches))
        del batches
        assert alive() is None, "a reference cycle keeps the iteration's batch alive"
    finally:
        gc.enable()
        lane.close()
    assert len(result.losses) == M


class _RefusingChannel:
    """A sending channel end whose ``post`` refuses every message, as a gloo channel refuses one
    it cannot encode or sends on after a failure; its receiving twin never delivers."""

    name, peer = "fwd 0->1", 1

    def post(self, msg, prepared=None):
        from rrfp.comm.message import MessageError

        raise MessageError(f"channel {self.name}: cannot send: {msg.label()} refused")

    async def recv(self):
        await asyncio.Event().wait()


def test_a_message_its_channel_refuses_fails_the_sender_not_the_task():
    """On real compute a task posts its message as it returns (``Channel.post``); what the channel
    refuses there is raised where a queued send's would be, by the stage's sender, so it is the
    iteration's one error and carries no task's note."""
    from rrfp.comm.message import MessageError

    torch.manual_seed(0)
    module = nn.Linear(6, 8)
    worker = StageWorker(module, 0, 2, M, _loss, split=True)
    settings = ScheduleSettings(M, Dispatch.READY, resolve("1f1b"), Budget.parse("2x"), True)
    lane = ComputeLane()
    channels = PipelineChannels(0, fwd_out=_RefusingChannel(), bwd_in=_RefusingChannel())
    ex = StageExecutor(worker, channels, lane, settings)
    try:
        with pytest.raises(MessageError, match="cannot send: F message .* refused") as got:
            asyncio.run(asyncio.wait_for(ex.run_iteration(0, _batches()), 30))
    finally:
        lane.close()
    assert not any("raised in task" in note for note in getattr(got.value, "__notes__", []))
