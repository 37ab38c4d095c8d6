"""Measuring stage modules' real F, B and W for the cost model (``rrfp calibrate``, embedders).

The stages run one after the other in this process, each task timed on its own, with the split
backward (W apart from B) as the runtime runs it. A module of one's own needs no ``Workload``:
``calibrate(modules, loss_fn, batches)`` returns the fitted ``CostModel`` to pass as ``cost=``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from rrfp.core.cost import CostModel
from rrfp.pipeline.schedule_settings import (
    DEFAULT_WEIGHT_SPLIT,
    resolve_weight_split,
    unsplit_stages_of,
)
from rrfp.pipeline.worker import StageWorker
from rrfp.pipeline.workload import map_tensors, token_features

Sample = tuple[int, int, dict, float]  # (stage, kind 0/1/2 for F/B/W, features, seconds)


def _timer(device: torch.device) -> Callable:
    """``timed(fn, *args) -> (out, seconds)``; on a GPU the seconds run to the end of the task's
    device work (kernels are queued asynchronously, so the host's clock alone would time their
    launch)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, *args):
        sync()
        t0 = time.perf_counter()
        out = fn(*args)
        sync()
        return out, time.perf_counter() - t0

    return timed


def measure_stages(
    modules: Sequence[nn.Module],
    loss_fn,
    batches: Iterable,
    features=token_features,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    progress=None,
    unsplit_stages: Sequence[int] = (),
    weight_split: str = DEFAULT_WEIGHT_SPLIT,
) -> list[Sample]:
    """(stage, kind, features, seconds) for every task of every microbatch of ``batches`` after the
    first ``warmup``: each task's best of two passes (a shape seen for the first time pays one-off
    costs). ``weight_split`` (``ScheduleSettings``'; "auto" resolved as for stages with no tensor,
    FSDP or expert parallelism) and ``unsplit_stages`` as the run has them: B and W cost what the
    run's cost, and an unsplit stage's B is its whole backward, its W nothing.
    ``modules`` are the pipeline's stages in order, already on ``device``; ``batches`` yields
    (inputs, targets); ``features(batch)`` says what a microbatch costs (``rrfp.token_features`` by
    default)."""
    device = torch.device(device)
    timed = _timer(device)
    S = len(modules)
    if S == 0:
        raise ValueError("calibrate needs at least one stage module")
    whole = unsplit_stages_of(unsplit_stages, S)
    mode = resolve_weight_split(weight_split, [])[0]
    workers = [
        StageWorker(m, s, S, 1, loss_fn, split=True, weight_split=mode, whole=s in whole)
        for s, m in enumerate(modules)
    ]

    def one_pass(batch) -> dict:
        times = {}
        x, y = (
            map_tensors(lambda t: t.to(device), batch[0]),
            map_tensors(lambda t: t.to(device), batch[1]),
        )
        for s, w in enumerate(workers):
            x, times[s, 0] = timed(w.forward, 0, x, y if s == S - 1 else None)
        grad = None
        for s in reversed(range(S)):
            grad, times[s, 1] = timed(workers[s].backward, 0, grad)
        for s in range(S):
            _, times[s, 2] = timed(workers[s].weight, 0)
            workers[s].reset()
            modules[s].zero_grad(set_to_none=True)
        return times

    out: list[Sample] = []
    batches = list(batches)
    for i, batch in enumerate(batches):
        feats = features(batch)
        first, second = one_pass(batch), one_pass(batch)
        if i >= warmup:
            out += [
                (s, k, feats, min(first[s, k], second[s, k])) for s in range(S) for k in range(3)
            ]
        if progress is not None:
            progress(i + 1, len(batches))
    if not out:
        raise ValueError(
            f"calibrate needs more than {warmup} microbatches (the first {warmup} warm up), "
            f"got {len(batches)}"
        )
    return out


def calibrate(
    modules: Sequence[nn.Module],
    loss_fn,
    batches: Iterable,
    features=token_features,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    unsplit_stages: Sequence[int] = (),
    weight_split: str = DEFAULT_WEIGHT_SPLIT,
) -> CostModel:
    """The cost model of these stage modules, fitted on their measured F, B and W over ``batches``
    (``measure_stages``). Microbatches should vary as the run's will (lengths, images), or the fit
    cannot tell what they cost."""
    return CostModel.fit(
        measure_stages(
            modules,
            loss_fn,
            batches,
            features,
            device,
            warmup,
            unsplit_stages=unsplit_stages,
            weight_split=weight_split,
        )
    )
