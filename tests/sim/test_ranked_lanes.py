"""The planner's stepped lanes (rrfp/sim/ranked_lanes.py) give every entry order the makespan
that ``RankedPipeline.run`` gives it, to the last bit, so the plan is the one scoring each order
by ``run`` makes; and they decline what they do not run (V > 1, zero-length tasks, rankings
that are not B, then F, then W)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.core.durations import known
from rrfp.core.entry_order import candidate_orders, entry_order_hint
from rrfp.core.hints import Hint
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig
from rrfp.sim.engine import _durations
from rrfp.sim.planned_hint import planned_config
from rrfp.sim.ranked import RankedPipeline, Ranking, bfw_ranking, ranking_of
from rrfp.sim.ranked_lanes import makespans


def _pipeline(cfg: SimConfig) -> RankedPipeline:
    dur, lat_f, lat_b, sizes = _durations(cfg)
    assert RankedPipeline.fits(lat_f, lat_b)
    limits = [cfg.the_budget.rank_limit(cfg.layout, r) for r in range(cfg.pp)]
    return RankedPipeline(dur, lat_f, lat_b, limits, sizes, cfg.split_backward, cfg.layout)


def _runs(p: RankedPipeline, rankings: list[Ranking]) -> list[float]:
    """The event loop's makespans, one ranking at a time."""
    runs = [p.run(r) for r in rankings]
    assert all(r is not None for r in runs)
    return [r.makespan for r in runs if r is not None]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(1, 7),
    M=st.integers(1, 16),
    preset=st.sampled_from(["none", "jitter", "lang", "mm"]),
    comm=st.sampled_from([0.0, 0.05, 0.5, 2.0]),
    seed=st.integers(0, 10_000),
    budget=st.sampled_from(["1", "2", "5", "1x", "1.5x", "2x", "3x", "3000B", "1B"]),
    split=st.booleans(),
    data=st.data(),
)
def test_lanes_give_the_event_loops_makespans(S, M, preset, comm, seed, budget, split, data):
    """Random entry orders (and the planner's own candidates) on random shapes, budgets counted
    and in bytes, links with and without latency; preset none ties every instant."""
    var = known(Variability.preset(preset, comm=comm))
    cfg = SimConfig(S, M, "bfw", "ready", budget, var, seed=seed, split=split, mb_bytes=1000)
    p = _pipeline(cfg)
    orders = candidate_orders(p.dur.sum(axis=(0, 2)))
    orders += [tuple(data.draw(st.permutations(range(M)))) for _ in range(2)]
    rankings = [bfw_ranking(o, split) for o in orders]
    assert makespans(p, rankings) == _runs(p, rankings)


def test_lanes_at_scale_with_ties():
    """Every task takes 1 (preset none): many lanes decide at one instant."""
    for S, M, budget in ((16, 64, "2x"), (32, 96, "1x"), (9, 40, "3")):
        cfg = SimConfig(S, M, "bfw", "ready", budget, Variability.preset("none"), split=True)
        p = _pipeline(cfg)
        rankings = [bfw_ranking(o, True) for o in candidate_orders(np.arange(M) % 5)]
        assert makespans(p, rankings) == _runs(p, rankings)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(8, 24),
    M=st.integers(32, 96),
    preset=st.sampled_from(["lang", "mm"]),
    seed=st.integers(0, 10_000),
    budget=st.sampled_from(["1x", "2x", "3", "3000B"]),
    split=st.booleans(),
    data=st.data(),
)
def test_lanes_that_finish_at_different_steps(S, M, preset, seed, budget, split, data):
    """Long enough runs that rankings finish many steps apart, in any order: the ones done last
    in the list are dropped while the others still step, and every makespan stays the event
    loop's."""
    var = known(Variability.preset(preset))
    cfg = SimConfig(S, M, "bfw", "ready", budget, var, seed=seed, split=split, mb_bytes=1000)
    p = _pipeline(cfg)
    orders = candidate_orders(p.dur.sum(axis=(0, 2)))
    orders += [tuple(data.draw(st.permutations(range(M)))) for _ in range(2)]
    orders = data.draw(st.permutations(orders))
    rankings = [bfw_ranking(o, split) for o in orders]
    assert makespans(p, rankings) == _runs(p, rankings)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(2, 12),
    M=st.integers(2, 48),
    preset=st.sampled_from(["lang", "mm", "jitter"]),
    seed=st.integers(0, 10_000),
    budget=st.sampled_from(["1x", "2x", "3"]),
)
def test_the_plan_is_the_one_scoring_each_order_by_the_event_loop(S, M, preset, seed, budget):
    """The planner scores its candidates on the lanes; scoring each with ``RankedPipeline.run``
    (and keeping the first best, as ``plan`` does) picks the same order, makespan and BFW
    makespan."""
    cfg = SimConfig(S, M, "plan", "ready", budget, Variability.preset(preset), seed=seed)
    _, made = planned_config(cfg)
    seen = replace(cfg, hint="bfw", variability=known(cfg.variability))
    p = _pipeline(seen)
    orders = candidate_orders(p.dur.sum(axis=(0, 2)))
    runs = _runs(p, [bfw_ranking(o, cfg.split_backward) for o in orders])
    best = min(range(len(orders)), key=lambda i: (runs[i], i))
    assert (made.order, made.predicted_makespan, made.bfw_makespan) == (
        orders[best],
        runs[best],
        runs[0],
    )


def test_what_the_lanes_decline():
    lang = known(Variability.preset("lang"))
    cfg = SimConfig(4, 8, "bfw", "ready", "2x", lang, seed=1)
    p = _pipeline(cfg)
    plain = bfw_ranking(range(8), True)
    assert makespans(p, [plain]) == _runs(p, [plain])
    zero = RankedPipeline(
        np.where(np.arange(8)[None, :, None] == 3, 0.0, p.dur),
        np.array([[x] for x in p.lat_f]),
        np.array([[x] for x in p.lat_b]),
        p.limits,
        p.sizes,
        True,
    )
    assert makespans(zero, [plain]) is None  # a zero-length task: rounds within an instant
    f, b, w = plain.priority  # F(0) outranks every B: not the class rule
    assert makespans(p, [Ranking(plain.order, ((-1,) + f[1:], b, w))]) is None
    virtual = replace(cfg, virtual=2, placement="interleaved")
    assert makespans(_pipeline(virtual), [plain]) is None
    assert makespans(p, []) is None


@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.integers(), min_size=1, max_size=20, unique=True), split=st.booleans())
def test_bfw_ranking_is_the_plan_hints_ranking(order, split):
    """The planner's rankings, made from its orders, are what ``ranking_of`` reads off the plan
    hint's priority."""
    M = len(order)
    entry = tuple(int(i) for i in np.argsort(order))  # any permutation of range(M)
    hint = Hint("plan", entry_order_hint(entry), is_class=True, uniform=True)
    assert bfw_ranking(entry, split) == ranking_of(hint.priority(3, 0, M, split), M, split)
