"""Measurements with a known cost model behind them, for the fitting and planning tests."""

from __future__ import annotations

import numpy as np

from rrfp.core.cost import FEATURES, CostModel


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


def constant_costs(
    split: list[tuple[float, float, float]], whole: list[tuple[float, float]]
) -> CostModel:
    """Every task a constant (seconds = its intercept): split[s] = (F, B, W), whole[s] = (F, B)
    when stage s runs unsplit; a typical microbatch, as `rrfp calibrate` of a split schedule
    writes one."""
    zero = (0.0,) * len(FEATURES)
    return CostModel(
        tuple(tuple((t, *zero) for t in kinds) for kinds in split),
        1.0,
        whole=tuple(((f, *zero), (b, *zero)) for f, b in whole),
        typical=(100.0, 0.0, 0.0),
    )


def cost_file(tmp_path, stages: int = 4, pays: int = 3) -> str:
    """A cost model of ``stages`` constant-time stages in which stage ``pays`` alone splits at a
    price (F and B + W 20% over its whole F and B), written to a file."""
    split = [(1.2, 1.2, 1.2) if s == pays else (1.0, 1.0, 1.0) for s in range(stages)]
    path = tmp_path / "cost.json"
    path.write_text(constant_costs(split, [(1.0, 2.0)] * stages).to_json())
    return str(path)
