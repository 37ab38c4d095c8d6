"""Classic schedules over virtual stages, as one rank's order of (stage, task) pairs.

Ported from torch 2.13's ``torch/distributed/pipelining/schedules.py`` (pure
Python, so the core stays free of torch), and held to torch's own
``_calculate_single_rank_operations`` by tests/core/test_virtual_hints.py:

- ``interleaved_1f1b``: ``ScheduleInterleaved1F1B`` (Megatron-LM's interleaved
  1F1B, arXiv 2104.04473): ``_get_warmup_ops`` with multiply factor 2, then
  ``_get_1f1b_rank_ops`` with rounds of ``M // max(1, M // S)`` microbatches.
- ``zbv``: ``ScheduleZBVZeroBubble`` (arXiv 2401.10241, section 6), V placement.

torch's idle slots (None) are dropped: an rrfp order is what a rank runs, in
order; when it waits is readiness's business. A whole backward (no split)
replaces torch's I and drops its W.
"""

from __future__ import annotations

from rrfp.core.placement import Placement, VirtualLayout
from rrfp.core.tasks import Kind, Task

StageOrder = list[tuple[int, Task]]


def _backward(stage: int, m: int, split: bool) -> StageOrder:
    return (
        [(stage, Task(Kind.B, m)), (stage, Task(Kind.W, m))]
        if split
        else [(stage, Task(Kind.B, m))]
    )


def interleaved_1f1b(layout: VirtualLayout, rank: int, M: int, split: bool) -> StageOrder:
    """torch's ScheduleInterleaved1F1B order on ``rank`` (interleaved placement); with a split
    backward each W follows its B at once, as in rrfp's 1f1b."""
    S, V = layout.ranks, layout.virtual
    if layout.placement is not Placement.INTERLEAVED:
        raise ValueError(
            f"interleaved 1F1B needs the interleaved placement, not {layout.placement}"
        )
    rounds = max(1, M // S)
    if M % rounds:
        raise ValueError(
            f"interleaved 1F1B needs the microbatches ({M}) to be a multiple of the number of "
            f"rounds max(1, M // S) = {rounds} (torch's rule)"
        )
    per_round = M // rounds
    warmup = min((V - 1) * per_round + 2 * (S - 1 - rank), M * V)
    total = M * V

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % V) * S + rank

    def bwd_stage(step: int) -> int:
        return (V - 1 - ((step - warmup) // per_round) % V) * S + rank

    f_next: dict[int, int] = {}
    b_next: dict[int, int] = {}
    out: StageOrder = []

    def forward(step: int) -> None:
        s = fwd_stage(step)
        f_next[s] = (m := f_next.get(s, 0)) + 1
        out.append((s, Task(Kind.F, m)))

    def backward(step: int) -> None:
        s = bwd_stage(step)
        b_next[s] = (m := b_next.get(s, 0)) + 1
        out.extend(_backward(s, m, split))

    for op in range(warmup):
        forward(op)
    for op in range(warmup, total):
        forward(op)
        backward(op)
    for op in range(total, total + warmup):
        backward(op)
    return out


def zbv(layout: VirtualLayout, rank: int, M: int, split: bool) -> StageOrder:
    """torch's ScheduleZBVZeroBubble order on ``rank`` (V placement, 2 stages per rank)."""
    S = layout.ranks
    if layout.placement is not Placement.V or layout.virtual != 2:
        raise ValueError("ZB-V needs the v placement with 2 stages per rank")
    padded = max(2 * S - 1, M)
    c0, c1 = rank, 2 * S - 1 - rank
    ops: list[tuple[int, Kind, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (S - rank) - 1):
        ops.append((c0, Kind.F, f0))
        f0 += 1
    for _ in range(rank):
        ops += [(c1, Kind.F, f1), (c0, Kind.F, f0)]
        f1 += 1
        f0 += 1
    for _ in range(S - rank):
        ops += [(c1, Kind.F, f1), (c1, Kind.B, b1), (c1, Kind.W, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < padded:
        if f0 < padded:
            ops.append((c0, Kind.F, f0))
            f0 += 1
        ops += [
            (c0, Kind.B, b0),
            (c0, Kind.W, b0),
            (c1, Kind.F, f1),
            (c1, Kind.B, b1),
            (c1, Kind.W, b1),
        ]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(c0, Kind.B, b0), (c1, Kind.B, b1)]
        b0 += 1
        b1 += 1
    for _ in range(S - rank):
        ops += [(c0, Kind.B, b0), (c0, Kind.W, w0)]
        b0 += 1
        w0 += 1
    ops += [(c1, Kind.W, w) for w in range(w1, b1)] + [(c0, Kind.W, w) for w in range(w0, b0)]
    out: StageOrder = []
    for s, kind, m in ops:
        if m >= M or (kind is Kind.W and not split):
            continue
        out.append((s, Task(kind, m)))
    return out


VIRTUAL_SCHEDULES = {"1f1b": interleaved_1f1b, "zbv": zbv}
"""Schedule hints with an order over virtual stages: 1f1b is interleaved 1F1B when V > 1."""
