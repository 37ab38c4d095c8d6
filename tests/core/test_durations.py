"""One emulated duration per task, whoever asks: the runtime's lane, the simulator and the bench."""

from __future__ import annotations

import numpy as np
import pytest

from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes
from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig
from rrfp.sim.engine import _durations


@pytest.mark.parametrize("split", [True, False])
def test_without_a_cost_model_realized_times_are_the_simulators_draws(split):
    var = Variability.preset("lang")
    dur = TaskTimes(var, 3, split).realized(5, 4, 6)
    sim = _durations(
        SimConfig(4, 6, "bfw" if split else "1f1b", variability=var, seed=3, iteration=5)
    )[0]
    assert np.allclose(dur, sim)
    assert (dur[:, :, 2] == 0).all() != split  # W is only drawn for a split backward


def test_with_a_cost_model_times_are_its_prediction_times_the_noise():
    coef = tuple(tuple((1e-3 * (s + k + 1), 1e-5, 0.0, 0.0) for k in range(3)) for s in range(2))
    cost, var = CostModel(coef, reference_s=2e-3), Variability.preset("jitter")
    feats = [{"tokens": 10.0 * (m + 1)} for m in range(3)]
    unsplit = TaskTimes(var, 0, False, cost)
    want = (
        (cost.seconds(1, 1, feats[2]) + cost.seconds(1, 2, feats[2]))
        / 2e-3
        * var.noise(0, 2, 1, 2, 1)
    )
    assert unsplit.units(2, 1, 2, Kind.B, feats) == pytest.approx(want)
    assert unsplit.realized(2, 2, 3, feats)[1, 2, 1] == pytest.approx(want)
    # the features matter: a longer microbatch lasts longer under the noise-free preset
    flat = TaskTimes(Variability.preset("none"), 0, True, cost)
    assert flat.units(0, 0, 2, Kind.F, feats) > flat.units(0, 0, 0, Kind.F, feats)
    # without features the cost model cannot apply: the preset's duration
    assert TaskTimes(var, 0, True, cost).units(2, 1, 2, Kind.F) == var.duration(
        0, 2, 1, 2, Kind.F, True
    )
