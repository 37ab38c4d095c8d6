"""Nominal orders: what ready dispatch does with a class priority when every
task takes its average time.

A class priority (BF, BFW) ranks B0 above F0, so it is no executable order;
its nominal order is one, for fixed dispatch and for ZB-H1. It is computed by
driving one ``RankTracker`` per rank through the simulator's event rule
(``rrfp.core.event_driver``), so it follows the same readiness rules and policy
as the runtime and the simulator.

With one stage per rank messages are free (every rank's next task starts on a
round). With virtual stages a message takes the simulator's default latency and
the V turn, which stays on the rank, none: an order made with free messages puts
a rank's next task where its input has not yet arrived, and ready dispatch beats
such an order even with nothing varying (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from rrfp.core.budget import Budget
from rrfp.core.event_driver import drive
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch, merge_local_priorities
from rrfp.core.rank_tracker import RankSpec, RankTracker, StageTask
from rrfp.core.tasks import Kind, Task
from rrfp.core.variability import Variability

# a message's time in nominal orders over virtual stages, in stage forwards
VIRTUAL_LATENCY = Variability().comm


@lru_cache(maxsize=16)
def nominal_orders(
    priority: Callable[[int, int, int, bool], Sequence[Task]],
    S: int,
    M: int,
    split: bool,
    multiple: float,
) -> tuple[tuple[Task, ...], ...]:
    """Per-stage orders under ``priority`` (a function giving stage s's tasks,
    best first) when F = B = W = 1, messages are free and the budget is
    ``multiple`` x 1F1B's: the rank orders of one stage per rank."""
    return tuple(
        tuple(t for _, t in order)
        for order in nominal_rank_orders(priority, VirtualLayout(S), M, split, multiple)
    )


@lru_cache(maxsize=16)
def nominal_rank_orders(
    priority: Callable[[int, int, int, bool], Sequence[Task]],
    layout: VirtualLayout,
    M: int,
    split: bool,
    multiple: float,
) -> tuple[tuple[tuple[int, Task], ...], ...]:
    """Per-rank orders over (stage, task) pairs under the class ``priority`` generalised to the
    rank's stages (``rrfp.core.policy.merge_local_priorities``), the budget ``multiple`` x 1F1B's
    over the rank (``Budget.rank_limit``). With one stage per rank every task takes one round and
    messages are free. With virtual stages a local stage's task takes 1/V of a forward (an unsplit
    B, which is B + W, 2/V) and a message between ranks ``VIRTUAL_LATENCY``, in the simulator's
    float arithmetic, so that fixed dispatch of the order repeats ready dispatch when nothing
    varies."""
    budget, S = Budget(multiple=multiple), layout.num_stages
    unit = 1.0 / layout.virtual  # a local stage does 1/V of a stage's work, as in the simulator
    latency = VIRTUAL_LATENCY if layout.virtual > 1 else 0.0
    whole_b = 2 * unit if layout.virtual > 1 and not split else unit  # an unsplit B is B + W
    trackers = []
    for r in range(layout.ranks):
        per_stage = {
            s: {t: i for i, t in enumerate(priority(S, s, M, split))} for s in layout.stages_of(r)
        }
        trackers.append(
            RankTracker(
                RankSpec(
                    layout,
                    r,
                    M,
                    split,
                    Dispatch.READY,
                    merge_local_priorities(per_stage),
                    (),
                    budget.rank_limit(layout, r),
                )
            )
        )
    out: list[list[tuple[int, Task]]] = [[] for _ in trackers]

    def decided(r: int, item: StageTask | None, now: float, end: float) -> None:
        if item is not None:
            out[r].append((item.stage, item.task))

    drive(
        trackers,
        [layout.rank_of(g) for g in range(S)],
        lambda g, t: whole_b if t.kind is Kind.B else unit,
        lambda g, t: latency,
        decided,
    )
    if not all(tr.done for tr in trackers):
        raise AssertionError(
            "nominal rank order stalled: "
            + "; ".join(f"rank {r} {tr.blocked()}" for r, tr in enumerate(trackers))
        )
    return tuple(tuple(o) for o in out)
