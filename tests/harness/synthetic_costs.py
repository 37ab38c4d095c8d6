"""Measurements with a known cost model behind them, for the fitting and planning tests."""

from __future__ import annotations

import numpy as np


def synthetic(seed=0, n=40, stages=2):
    rng = np.random.default_rng(seed)
    truth = {
        (s, k): (1e-3 * (s + 1), 2e-6 * (k + 1), 1e-8, 5e-7)
        for s in range(stages)
        for k in range(3)
    }
    rows = []
    for _ in range(n):
        T, b, patches = int(rng.integers(16, 128)), 4, float(rng.integers(0, 4) * 16)
        feats = {"tokens": float(b * T), "attn": float(b * T * T), "patches": patches}
        for (s, k), c in truth.items():
            rows.append(
                (s, k, feats, c[0] + c[1] * feats["tokens"] + c[2] * feats["attn"] + c[3] * patches)
            )
    return truth, rows
