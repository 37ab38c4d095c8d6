"""The simulator's fast path (rrfp/sim/ranked.py) makes exactly the trackers' decisions:
the same timeline, busy time, peak in-flight and decision count as stepping every
StageTracker, or every RankTracker with virtual stages (``simulate(cfg, reference=True)``),
for every hint, budget, layout and preset it takes, zero-length tasks and tied instants
included; and it declines what it cannot run exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.core.entry_order import entry_order_hint
from rrfp.core.hints import Hint, bfw_ranked, resolve
from rrfp.core.tasks import Kind, Task
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, simulate
from rrfp.sim.engine import _durations, _ranked
from rrfp.sim.ranked import ranking_of


def _same(cfg: SimConfig) -> None:
    cfg = replace(cfg, record=True)
    assert _ranked(cfg, *_durations(cfg)) is not None, "this config should take the fast path"
    fast, ref = simulate(cfg), simulate(cfg, reference=True)
    assert fast.makespan == ref.makespan
    assert fast.timeline == ref.timeline
    assert [st.busy for st in fast.stats] == [st.busy for st in ref.stats]
    assert fast.peak_inflight == ref.peak_inflight
    assert [st.decisions for st in fast.stats] == [st.decisions for st in ref.stats]
    assert fast.lower_bound == ref.lower_bound
    assert fast.stage_stats == ref.stage_stats  # V > 1: busy and peak per global stage


def _plan_hint(order) -> Hint:
    return Hint("plan", entry_order_hint(order), is_class=True, uniform=True)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(1, 6),
    M=st.integers(1, 14),
    preset=st.sampled_from(["none", "jitter", "lang", "mm"]),
    comm=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    seed=st.integers(0, 10_000),
    budget=st.sampled_from(["1", "2", "5", "1x", "1.5x", "2x", "3x", "3000B", "1B"]),
    hint=st.sampled_from(["bfw", "bf", "plan", "order"]),
    split=st.sampled_from([None, True, False]),
    zeros=st.booleans(),
    data=st.data(),
)
def test_fast_path_makes_the_trackers_decisions(
    S, M, preset, comm, seed, budget, hint, split, zeros, data
):
    var = Variability.preset(preset, comm=comm)
    if hint == "order":  # a planned entry order
        h = _plan_hint(data.draw(st.permutations(range(M))))
    else:
        h = resolve(hint)
    cfg = SimConfig(S, M, h, "ready", budget, var, seed=seed, split=split, mb_bytes=1000)
    if (
        zeros
    ):  # zero-length tasks (a cost model may predict 0 s): events at one instant in several rounds
        dur = _durations(cfg)[0]
        dur[np.random.default_rng(seed).random(dur.shape) < 0.4] = 0.0
        cfg = replace(cfg, durations=dur.tolist())
    _same(cfg)


def test_fast_path_at_scale_and_with_ties():
    """preset none: every task takes 1, so many events share an instant."""
    for S, M, budget in ((8, 32, "2x"), (16, 64, "1x"), (5, 40, "3")):
        _same(SimConfig(S, M, "bfw", "ready", budget, Variability.preset("none")))
        _same(SimConfig(S, M, "bfw", "ready", budget, Variability.preset("lang"), seed=3))


@pytest.mark.parametrize("budget", ["2x", "1x", "3", "4000B"])
def test_one_stage_per_rank_runs_the_rank_loop(budget):
    """V = 1 is the one-stage case of the rank loop: no layout and ``VirtualLayout(S)`` run alike,
    and both make the trackers' decisions."""
    from rrfp.core.placement import VirtualLayout
    from rrfp.sim.ranked import RankedPipeline

    for S, M, preset in ((4, 16, "lang"), (8, 32, "none"), (3, 7, "lang")):
        cfg = SimConfig(S, M, "bfw", "ready", budget, Variability.preset(preset), seed=S)
        dur, lat_f, lat_b, sizes = _durations(cfg)
        limits = [cfg.budget.rank_limit(cfg.layout, r) for r in range(S)]
        ranking = ranking_of(cfg.hint.priority(S, 0, M, True), M, True)
        plain = RankedPipeline(dur, lat_f, lat_b, limits, sizes, True).run(ranking, record=True)
        laid = RankedPipeline(dur, lat_f, lat_b, limits, sizes, True, VirtualLayout(S)).run(
            ranking, record=True
        )
        assert plain == laid
        _same(cfg)


@pytest.mark.parametrize("layout", [(1, "interleaved"), (2, "v"), (3, "interleaved")])
def test_what_the_fast_path_declines(layout):
    V, placement = layout
    lang = Variability.preset("lang")
    base = SimConfig(4, 8, "bfw", "ready", "2x", lang, seed=1, virtual=V, placement=placement)
    assert _ranked(base, *_durations(base)) is not None
    schedule = "zbv" if placement == "v" else "1f1b"  # a schedule hint: no class rule
    for cfg in (
        replace(base, dispatch="fixed"),
        replace(base, hint=resolve(schedule)),
        replace(base, hint=resolve("gpipe")),
        replace(
            base, variability=replace(lang, comm_jitter=0.3)
        ),  # arrivals can overtake each other
        replace(base, hint=Hint("bfw", resolve("bfw").fn, is_class=True)),
    ):  # not known to be uniform
        assert _ranked(cfg, *_durations(cfg)) is None
        assert simulate(cfg).makespan == simulate(cfg, reference=True).makespan


VIRTUAL_BUDGETS = ["0.5x", "1x", "1.5x", "2x", "3x", "4x", "1", "3", "3000B", "1B"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(1, 5),
    M=st.integers(1, 12),
    layout=st.sampled_from([(2, "interleaved"), (2, "v"), (3, "interleaved")]),
    preset=st.sampled_from(["none", "lang"]),
    comm=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 10_000),
    budget=st.sampled_from(VIRTUAL_BUDGETS),
    hint=st.sampled_from(["bfw", "bf", "plan"]),
    split=st.sampled_from([True, False]),
    zeros=st.booleans(),
)
def test_fast_path_makes_the_rank_trackers_decisions(
    S, M, layout, preset, comm, seed, budget, hint, split, zeros
):
    """V > 1: the rank's choice among its stages' heads (merged local priorities, the lead limit,
    the reserve, bytes, later local stages past a refused forward), the V turn delivered at
    once."""
    from rrfp.sim.planned_hint import planned_config

    V, placement = layout
    var = Variability.preset(preset, comm=comm)
    cfg = SimConfig(
        S,
        M,
        hint,
        "ready",
        budget,
        var,
        seed=seed,
        split=split,
        mb_bytes=1000 * V,
        virtual=V,
        placement=placement,
    )
    if hint == "plan":
        cfg = planned_config(cfg)[0]
    if (
        zeros
    ):  # zero-length tasks: events at one instant in several rounds, and turns at one instant
        dur = _durations(cfg)[0]
        dur[np.random.default_rng(seed).random(dur.shape) < 0.4] = 0.0
        cfg = replace(cfg, durations=dur.tolist())
    _same(cfg)


@pytest.mark.parametrize("placement", ["interleaved", "v"])
def test_fast_path_at_scale_with_virtual_stages(placement):
    """8 x 32 at V = 2, the benchmark's shape: unit tasks (many ties) and lang; the planned hint."""
    from rrfp.sim.planned_hint import planned_config

    for budget in ("2x", "1x", "0.5x", "8"):  # 0.5x: the tightest, where the reserve binds
        _same(
            SimConfig(
                8,
                32,
                "bfw",
                "ready",
                budget,
                Variability.preset("none"),
                virtual=2,
                placement=placement,
            )
        )
        lang = SimConfig(
            8,
            32,
            "plan",
            "ready",
            budget,
            Variability.preset("lang"),
            seed=5,
            virtual=2,
            placement=placement,
        )
        _same(planned_config(lang)[0])
    _same(
        SimConfig(
            8, 32, "bf", "ready", "2x", Variability.preset("lang"), seed=2, split=False, virtual=3
        )
    )


def test_ranking_needs_one_order_for_every_kind():
    M = 4
    prio = {t: i for i, t in enumerate(bfw_ranked([2, 0, 3, 1], True))}
    r = ranking_of(prio, M, True)
    assert (
        r.order == (2, 0, 3, 1)
        and r.priority[Kind.B] == (0, 1, 2, 3)
        and r.priority[Kind.F] == (4, 5, 6, 7)
    )
    swapped = dict(prio)
    swapped[Task(Kind.B, 2)], swapped[Task(Kind.B, 0)] = (
        prio[Task(Kind.B, 0)],
        prio[Task(Kind.B, 2)],
    )
    assert ranking_of(swapped, M, True) is None  # B ranks 0 before 2, F ranks 2 before 0
    assert (
        ranking_of({t: p for t, p in prio.items() if t.kind != Kind.W}, M, True) is None
    )  # a W missing
    assert ranking_of({t: p for t, p in prio.items() if t.kind != Kind.W}, M, False).order == (
        2,
        0,
        3,
        1,
    )


@pytest.mark.parametrize("budget", ["2x", "1x"])
@pytest.mark.parametrize("layout", [(1, "interleaved"), (2, "v"), (2, "interleaved")])
def test_plans_are_scored_on_the_fast_path_as_on_the_trackers(budget, layout):
    """make_plan's candidates, scored on the fast path, get the makespans the trackers give them."""
    from rrfp.core.durations import known
    from rrfp.sim.planned_hint import planned_config

    V, placement = layout
    var = Variability.preset("lang")
    for seed in range(3):
        cfg = SimConfig(
            8, 24, resolve("plan"), "ready", budget, var, seed=seed, virtual=V, placement=placement
        )
        planned, made = planned_config(cfg)
        seen = replace(planned, variability=known(var))
        assert simulate(seen, reference=True).makespan == made.predicted_makespan
        plain = replace(seen, hint=resolve("bfw"))
        assert simulate(plain, reference=True).makespan == made.bfw_makespan
