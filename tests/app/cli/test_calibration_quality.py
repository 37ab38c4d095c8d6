"""How far a calibration can be trusted, on synthetic measurements with a known truth: the held-out
error is measured on microbatches the fit never saw, a busy machine is named, and a fitted term
below zero that matters is flagged while one within noise is not."""

from __future__ import annotations

import random

from rrfp.app.cli.calibration_quality import (
    held_out_errors,
    load_warning,
    negative_terms,
    split_held_out,
)
from rrfp.core.cost import CostModel


def synthetic(per_token: float, intercept: float, noise: float, n: int = 24, seed: int = 0):
    """(stage, kind, features, seconds) for n microbatches on 2 stages, every task
    intercept + per_token * tokens, times a lognormal-ish noise factor."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = 100.0 + 50.0 * i
        feats = {"tokens": tokens, "attn": 0.0, "patches": 0.0}
        for s in range(2):
            for k in range(3):
                t = (intercept + per_token * tokens) * (1.0 + rng.uniform(-noise, noise))
                out.append((s, k, feats, t))
    return out


def test_held_out_half_is_disjoint_and_alternates_microbatches():
    samples = synthetic(1e-6, 1e-3, 0.0, n=6)
    fit, held = split_held_out(samples, per_microbatch=6)
    assert len(fit) == len(held) == 18
    assert {f["tokens"] for _, _, f, _ in fit} == {100.0, 200.0, 300.0}
    assert {f["tokens"] for _, _, f, _ in held} == {150.0, 250.0, 350.0}


def test_held_out_error_is_what_the_noise_puts_there():
    exact = synthetic(1e-6, 1e-3, 0.0)
    fit, held = split_held_out(exact, 6)
    assert max(held_out_errors(CostModel.fit(fit), held)) < 1e-9
    noisy = synthetic(1e-6, 1e-3, 0.2, seed=3)
    fit, held = split_held_out(noisy, 6)
    errors = held_out_errors(CostModel.fit(fit), held)
    assert 0.02 < sorted(errors)[len(errors) // 2] < 0.2


def test_a_negative_weight_that_matters_is_flagged():
    # time falls with tokens: no task does that, the fit says so
    falling = synthetic(-2e-6, 5e-3, 0.0)
    flagged = negative_terms(CostModel.fit(falling), falling)
    assert len(flagged) == 6 and all("tokens" in t for t in flagged), flagged
    assert flagged[0].startswith("stage 0 F: tokens -2 us each")
    honest = synthetic(1e-6, 1e-3, 0.02, seed=1)
    assert negative_terms(CostModel.fit(honest), honest) == []


def test_a_negative_intercept_that_matters_is_flagged():
    steep = synthetic(1e-6, -5e-5, 0.0)  # -50 us against tasks of 50 us to 1.3 ms
    flagged = negative_terms(CostModel.fit(steep), steep)
    assert flagged and all("intercept" in t for t in flagged), flagged


def test_load_warning_names_a_busy_machine_only():
    assert load_warning(1.0, cores=2, threads=1) is None  # only this process
    assert load_warning(None, cores=2, threads=1) is None  # no load average on this platform
    busy = load_warning(3.4, cores=2, threads=1)
    assert busy is not None and "load average 3.40 on 2 cores" in busy and "unreliable" in busy
    assert load_warning(17.0, cores=16, threads=16) is None
    assert load_warning(21.0, cores=16, threads=16) is not None
