"""The moe preset: a routed task waits for its EP group's busiest rank; the backward routes the
forward's tokens; the planner sees only the mean; the draws match the measurements they cite."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.core.durations import TaskTimes, known
from rrfp.core.tasks import Kind
from rrfp.core.variability import MOE_A2A, MOE_EXCESS, MOE_EXPERT, Variability

MOE = Variability.preset("moe")
keys = st.integers(min_value=0, max_value=2**31)


@settings(max_examples=60, deadline=None)
@given(seed=keys, it=keys, stage=st.integers(0, 63), a=keys, b=keys)
def test_backward_follows_the_forwards_routing(seed, it, stage, a, b):
    """B and W of a microbatch take the load its F drew: one microbatch's F is longer than
    another's exactly when its B and its W are."""
    load = MOE.load(seed, it, stage, np.array([a, b]))
    f, bw, w = (MOE.duration(seed, it, stage, np.array([a, b]), k) for k in Kind)
    assert f[0] == pytest.approx(bw[0])  # F and B hold the same shares of dense, experts, a2a
    assert np.sign(f[0] - f[1]) == np.sign(w[0] - w[1]) == np.sign(load[0] - load[1])


@settings(max_examples=60, deadline=None)
@given(
    expert=st.floats(0.0, 0.9),
    a2a=st.floats(0.0, 0.1),
    excess=st.floats(0.01, 2.0),
    sigma=st.floats(0.0, 1.5),
    seed=keys,
    mb=st.lists(keys, min_size=2, max_size=8),
)
def test_a_task_grows_with_its_load_and_keeps_its_dense_part(expert, a2a, excess, sigma, seed, mb):
    var = Variability(moe_expert=expert, moe_a2a=a2a, moe_excess=excess, moe_sigma=sigma)
    mb = np.array(mb)
    load = var.load(seed, 0, 1, mb)
    assert (load >= 1).all()
    for kind in (Kind.F, Kind.W):
        routed = expert + (a2a if kind == Kind.F else 0.0)
        t = var.duration(seed, 0, 1, mb, kind)
        order = np.argsort(load, kind="stable")
        assert (np.diff(t[order]) >= -1e-12).all()  # never shorter with more load
        # never below the balanced task (load 1) over the mean
        assert (t >= 1.0 / (1.0 + routed * excess) - 1e-12).all()


def test_the_draws_match_what_they_cite():
    """Mean one per kind; the busiest rank's load 1.23x the mean, so that an EP rank waits
    18.6% of the layer's expert time (FEPLB); its 99th percentile near 1.9x (MicroMoE)."""
    m = np.arange(200_000)
    load = MOE.load(0, 0, 3, m)
    assert load.mean() == pytest.approx(1 + MOE_EXCESS, abs=0.01)
    assert (1 - 1 / load).mean() == pytest.approx(0.186, abs=0.02)
    assert 1.7 < np.percentile(load, 99) < 2.1
    for kind in Kind:
        assert MOE.duration(0, 0, 3, m, kind).mean() == pytest.approx(1.0, abs=0.005)
    # F's spread: only the routed share (experts and all-to-all) varies
    f = MOE.duration(0, 0, 3, m, Kind.F)
    routed = MOE_EXPERT + MOE_A2A
    assert f.std() == pytest.approx(routed * load.std() / (1 + routed * MOE_EXCESS), rel=1e-6)


def test_each_stage_routes_on_its_own():
    """Each stage's layers route a microbatch independently: no length factor shared across
    stages as in lang."""
    m = np.arange(20_000)
    a, b = MOE.duration(0, 0, 0, m, Kind.F), MOE.duration(0, 0, 5, m, Kind.F)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05
    assert MOE.duration(0, 1, 0, 7, Kind.F) != MOE.duration(0, 0, 0, 7, Kind.F)


def test_the_planner_sees_the_mean():
    """The router decides as the task runs: what a planner knows is every task at its mean."""
    times = TaskTimes(MOE, seed=3)
    assert np.allclose(times.predicted(2, 4, 8)[:, :, : len(Kind)], 1.0)
    assert not np.allclose(times.realized(2, 4, 8), 1.0)
    assert known(MOE).moe_excess == 0.0


def test_the_noise_carries_the_routing():
    """A data-driven duration (cost model x noise) waits for the busiest rank too."""
    assert MOE.noise(1, 2, 3, 4, Kind.F) == pytest.approx(MOE.duration(1, 2, 3, 4, Kind.F))
    assert Variability.preset("moe", moe_excess=0.0).noise(1, 2, 3, 4, Kind.F) == 1.0


def test_shares_of_one_task():
    with pytest.raises(ValueError, match="moe_expert=0.95 \\+ moe_a2a=0.1"):
        Variability.preset("moe", moe_expert=0.95)
