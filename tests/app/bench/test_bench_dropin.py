"""The bench's drop-in contender (rrfp/app/bench/dropin.py) holds every task of ScheduleReady's
executor for the ready rows' emulated duration: the lane's unit and the executor's variability
reach the runtime that ScheduleReady starts for itself. Two gloo ranks, a few seconds."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

M, UNIT_MS, STEPS = 4, 20.0, 2


def _durations(rank, world):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp.app.bench.dropin import EmulatedScheduleReady, TorchCall
    from rrfp.core.durations import TaskTimes
    from rrfp.core.tasks import Kind
    from rrfp.core.variability import Variability
    from rrfp.observe.instrument import TraceRecorder
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    # stage 1 three times slower: an executor left with the default durations would run it at 1x
    var = Variability.preset("lang", slow_stage=1, slow_factor=3.0)
    recorder = TraceRecorder("drop-in")
    stage = PipelineStage(TorchCall(module), rank, world, torch.device("cpu"))
    sched = EmulatedScheduleReady(
        stage,
        M,
        lambda out, y: ((out - y) ** 2).mean(),
        unit_ms=UNIT_MS,
        instrument=recorder,
        settings=ScheduleSettings.of(M, hint="bfw", variability=var, seed=0),
    )
    try:
        for it in range(STEPS):
            assert sched.steps == it
            xs = [torch.randn(2, 8) for _ in range(M)]
            sched.step(
                arg_mbs=[(x,) for x in xs] if rank == 0 else None,
                target_mbs=[torch.zeros(2, 8)] * M if rank == world - 1 else None,
            )
    finally:
        sched.close()
    times = TaskTimes(var, 0, True, None)
    kinds = {"F": Kind.F, "B": Kind.B, "W": Kind.W}
    out = []
    for sp in recorder.spans:
        if sp.name == "wait":
            continue
        kind, mb = kinds[sp.name[0]], int(sp.name[1:])
        out.append(
            (
                sp.args["iteration"],
                sp.name,
                sp.end - sp.start,
                times.units(sp.args["iteration"], rank, mb, kind) * UNIT_MS / 1000,
            )
        )
    dist.destroy_process_group()
    return out


def test_drop_in_tasks_hold_the_ready_executors_emulated_durations():
    results = run_ranks(_durations, 2, timeout=90)
    for rank, spans in results.items():
        assert sorted((it, name) for it, name, _, _ in spans) == sorted(
            (it, f"{k}{mb}") for it in range(STEPS) for k in "FBW" for mb in range(M)
        ), rank
        for it, name, held, emulated in spans:
            # the lane holds a task for its emulated time (the tiny Linear computes in far less)
            assert held >= emulated - 1e-3, (rank, it, name, held, emulated)
    slow = [emulated for _, _, _, emulated in results[1]]
    fast = [emulated for _, _, _, emulated in results[0]]
    assert sum(slow) > 2 * sum(fast)  # the slow stage is in the durations the check above used
