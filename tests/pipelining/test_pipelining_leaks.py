"""A ScheduleReady step leaves nothing of itself behind: once ``step`` returns, no reference cycle
holds the step's inputs, targets or outputs, at one stage per rank and at two, and the same for
``eval``. Checked the way
torch's own pipelining tests check their schedules (``check_leaked_tensors`` in
torch/testing/_internal/common_utils.py: the tensors the cyclic GC finds unreachable after the
step), and with the cyclic GC off, as a user who disables it would run: the whole batch (which the
microbatches are views of), the target and every stage output must be freed by reference counting
alone."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.distributed import run_ranks
from harness.pipelining_model import BATCH, M, batch, full_model, loss_fn

pytestmark = pytest.mark.multirank


def _step_leaves_nothing(rank, world, V, call):
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady

    dist.init_process_group("gloo")
    S = world * V
    mine = [rank + v * world for v in range(V)]  # interleaved
    model = full_model(S)
    stages = [PipelineStage(copy.deepcopy(model[s]), s, S, torch.device("cpu")) for s in mine]
    first, last = 0 in mine, S - 1 in mine
    outputs: list = []  # weak references to what each stage module returned

    def keep_weakly(module, args, out):
        outputs.append(weakref.ref(out))

    for s in stages:
        s.submod.register_forward_hook(keep_weakly)
    result = {}
    try:
        with ScheduleReady(stages if V > 1 else stages[0], M, loss_fn=loss_fn) as schedule:

            def step(seed: int):
                x, y = batch(seed, 5)
                run = schedule.step if call == "step" else schedule.eval
                merged = run(*((x,) if first else ()), target=y if last else None)
                return weakref.ref(x), weakref.ref(y), merged

            step(1)  # the first step builds what lives across steps
            outputs.clear()
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what the cyclic GC would free is kept in gc.garbage
            try:
                x, y, merged = step(2)
                result["batch alive"] = x() is not None
                result["target alive"] = y() is not None
                result["outputs alive"] = sum(o() is not None for o in outputs)
                result["outputs"] = len(outputs)
                result["merged"] = None if merged is None else tuple(merged.shape)
                del merged
                gc.collect()
                result["tensors in cycles"] = [
                    (type(t).__name__, tuple(t.shape))
                    for t in gc.garbage
                    if isinstance(t, torch.Tensor)
                ]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
    finally:
        dist.destroy_process_group()
    return result


@pytest.mark.parametrize("call", ["step", "eval"])
@pytest.mark.parametrize("V", [1, 2])
def test_no_reference_cycle_keeps_a_step_alive(V, call):
    world = 2
    results = run_ranks(_step_leaves_nothing, world, V, call, timeout=120)
    for rank, res in results.items():
        assert res["outputs"] == M * V, (rank, res)  # every forward of the step was seen
        assert res["outputs alive"] == 0, (rank, res)
        assert not res["batch alive"] and not res["target alive"], (rank, res)
        assert res["tensors in cycles"] == [], (rank, res)
    # the output the last stage returned is the caller's, not a leak
    assert results[world - 1]["merged"][:2] == (BATCH * M, 5)
