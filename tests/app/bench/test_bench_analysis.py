"""The bench's figures: bounds and predictions on the durations the simulator itself draws, and
speedups paired by iteration."""

from __future__ import annotations

import pytest

from rrfp.app.bench.analysis import annotate, paired_ratios, summarize
from rrfp.app.bench.suite import BenchSpec, Case, Contender
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planned_hint import planned_config

CONTENDERS = ("fixed 1f1b", "fixed zbh1", "ready bfw", "ready plan", "fixed plan", "torch 1f1b")


def spec() -> BenchSpec:
    case = Case(
        "gpt",
        "unused.toml",
        "lang",
        False,
        contenders=tuple(Contender.parse(e) for e in CONTENDERS),
    )
    return BenchSpec((case,), pp=4, n_microbatches=8, reps=3, unit_ms=10.0)


def test_annotate_bounds_and_predicts_on_the_simulators_own_durations():
    sp, var = spec(), Variability.preset("lang")
    rows = []
    for it in (1, 2, 3):
        for name in ("fixed 1f1b", "fixed zbh1", "ready bfw", "ready plan", "fixed plan"):
            contender = Contender.parse(name)
            # the simulator draws its own durations (and plans from them): the bench must rebuild
            # the same
            cfg = SimConfig(
                4, 8, contender.hint, contender.dispatch, "2x", var, seed=0, iteration=it
            )
            res = simulate(planned_config(cfg)[0] if contender.hint == "plan" else cfg)
            rows.append(
                {
                    "contender": name,
                    "iteration": it,
                    "wall_s": res.makespan * 0.01,
                    "peak_inflight": None,
                    "decision_us": None,
                    "plan_s": None,
                    "sim_lb": res.lower_bound * 0.01,
                }
            )
        rows.append(
            {
                "contender": "torch 1f1b",
                "iteration": it,
                "wall_s": 1.0,
                "peak_inflight": None,
                "decision_us": None,
                "plan_s": None,
            }
        )
    annotate(sp, sp.cases[0], var, None, rows, [])
    for r in rows:
        if r["contender"] == "torch 1f1b":
            assert r["simulated_s"] is None  # torch's schedules are not simulated
            continue
        assert r["simulated_s"] == pytest.approx(r["wall_s"])
        assert r["lower_bound_s"] == pytest.approx(r["sim_lb"])
        assert 0 < r["efficiency"] <= 1 + 1e-9
    # the bound follows each contender's split: torch's 1F1B has fixed 1F1B's, and a split
    # backward's chain is no longer than the unsplit one's
    by = {(r["contender"], r["iteration"]): r["lower_bound_s"] for r in rows}
    assert all(
        by["torch 1f1b", it] == by["fixed 1f1b", it] >= by["fixed zbh1", it] - 1e-12
        for it in (1, 2, 3)
    )


def test_speedups_are_paired_by_iteration():
    rows = [
        {
            "contender": e,
            "iteration": i,
            "wall_s": w,
            "peak_inflight": p,
            "decision_us": 1.0,
            "plan_s": None,
            "efficiency": 0.5,
        }
        for e, p, walls in (("fixed 1f1b", 4, (2.0, 4.0, 3.0)), ("ready bfw", 8, (1.0, 4.0, 2.0)))
        for i, w in zip((1, 2, 3), walls)
    ]
    assert paired_ratios(rows, "fixed 1f1b", "ready bfw") == [2.0, 1.0, 1.5]
    base, ready = summarize(rows, ["fixed 1f1b", "ready bfw", "not run"])
    assert base.speedup.median == 1.0 and ready.speedup.median == 1.5
    assert (ready.speedup.low, ready.speedup.high) == (1.0, 2.0)
    # the ratio of medians would differ (3.0 / 2.0): pairing is what is reported
    assert ready.wall_s.median == 2.0 and base.wall_s.median == 3.0
    assert ready.peak_inflight == 8 and ready.vs_simulated is None
