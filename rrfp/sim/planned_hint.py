"""The planned hint: score entry orders by simulating the predicted durations,
and turn the best into a hint.

The simulator, the runtime, the bench and ``rrfp sim --replay`` all plan
through ``plan_iteration``. What the planner knows is the predictable part of
each task's time (``TaskTimes.predicted``: the cost model's prediction, or the
preset's size factors, and a slow stage); the run it is judged by has jitter,
stragglers and link jitter on top, and the planner never sees them, whatever
durations a caller's config carries. Fixed dispatch with a plan replays what
ready dispatch would do on the predicted durations (plan, then replay a fixed
order, as planners that do not adapt at run time do): the ablation beside
ready plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from rrfp.core.budget import Budget
from rrfp.core.cost import Features
from rrfp.core.durations import TaskTimes, known
from rrfp.core.entry_order import Plan, entry_order_hint, plan
from rrfp.core.hints import Hint
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.sim.engine import SimConfig, _durations, simulate
from rrfp.sim.ranked import RankedPipeline, bfw_ranking, ranking_of
from rrfp.sim.ranked_lanes import makespans


def make_plan(
    predicted: npt.NDArray[np.float64],
    budget: Budget,
    variability: Variability,
    split: bool,
    dispatch: Dispatch = Dispatch.READY,
    *,
    seed: int = 0,
    iteration: int = 0,
    layout: VirtualLayout | None = None,
) -> tuple[Hint, Plan]:
    """The hint for one iteration from ``predicted[s, m, kind]`` (global stages of ``layout``,
    default one per rank); ``variability`` gives the link latency the planner assumes (its jitter
    is hidden) and, with ``seed`` and ``iteration``, the microbatch sizes a byte budget weighs."""
    N, M, _ = predicted.shape
    layout = layout or VirtualLayout(N)
    S = layout.ranks
    base = SimConfig(
        S,
        M,
        "bfw",
        Dispatch.READY,
        budget,
        known(variability),
        seed=seed,
        iteration=iteration,
        split=split,
        durations=predicted,
        virtual=layout.virtual,
        placement=layout.placement,
    )

    def hint(order: Sequence[int]) -> Hint:
        return Hint("plan", entry_order_hint(order), is_class=True, uniform=True)

    dur, lat_f, lat_b, sizes = _durations(base)
    pipeline = None  # the simulator's fast path (known latencies have no jitter, so it fits)
    if RankedPipeline.fits(lat_f, lat_b):
        pipeline = RankedPipeline(
            dur,
            lat_f,
            lat_b,
            [budget.rank_limit(layout, r) for r in range(S)],
            sizes,
            split,
            layout,
        )

    # every candidate shares the durations, latencies and sizes: the pipeline is set up once
    def score(order: Sequence[int]) -> float:
        run = None
        if pipeline is not None:
            ranking = ranking_of(hint(order).priority(N, 0, M, split), M, split)
            run = pipeline.run(ranking) if ranking is not None else None
        return (
            run.makespan if run is not None else simulate(replace(base, hint=hint(order))).makespan
        )

    def scores(orders: Sequence[Sequence[int]]) -> list[float]:
        """All candidates at once on the stepped lanes where they apply, else one by one."""
        if pipeline is not None:
            fast = makespans(pipeline, [bfw_ranking(o, split) for o in orders])
            if fast is not None:
                return fast
        return [score(o) for o in orders]

    made = plan(predicted, scores)
    if dispatch is not Dispatch.FIXED:
        return hint(made.order), made
    run = simulate(replace(base, hint=hint(made.order), record=True))
    timeline = sorted(run.timeline, key=lambda e: e[2])
    rank_orders = tuple(
        tuple((st, t) for st, t, *_ in timeline if layout.rank_of(st) == r) for r in range(S)
    )
    return replace(hint(made.order), fixed_rank_orders=rank_orders), made


def plan_iteration(
    times: TaskTimes,
    iteration: int,
    stages: int,
    n_microbatches: int,
    budget: Budget,
    dispatch: Dispatch,
    features: Sequence[Features] | None = None,
) -> tuple[Hint, Plan]:
    """One iteration's plan from what is known before it runs: ``times.predicted`` (the cost model
    on ``features``, or the preset's size factors), never the realized durations. ``stages`` counts
    ranks; with virtual stages ``times.layout`` says how many stages each holds."""
    layout = times.layout or VirtualLayout(stages)
    predicted = times.predicted(iteration, layout.num_stages, n_microbatches, features)
    return make_plan(
        predicted,
        budget,
        times.variability,
        times.split,
        dispatch,
        seed=times.seed,
        iteration=iteration,
        layout=layout,
    )


def planned_config(cfg: SimConfig) -> tuple[SimConfig, Plan]:
    """``cfg`` with its hint replaced by this seed's plan, made from the preset's
    predictable part (per-microbatch factors, a slow stage). A config that carries
    durations (a replay's realized ones) is refused: plan it with ``plan_iteration``
    from the run's TaskTimes and features instead."""
    if cfg.durations is not None:
        raise ValueError(
            "planned_config plans from the preset, but this config carries its own durations "
            "(realized ones, which the planner must not see): use plan_iteration with the "
            "run's TaskTimes and features"
        )
    times = TaskTimes(
        cfg.variability,
        cfg.seed,
        cfg.split_backward,
        layout=cfg.layout,
    )
    made_hint, made = plan_iteration(
        times,
        cfg.iteration,
        cfg.pp,
        cfg.n_microbatches,
        Budget.parse(cfg.budget),
        Dispatch.parse(cfg.dispatch),
    )
    return replace(cfg, hint=made_hint), made
