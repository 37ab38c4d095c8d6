"""The cost model: fitting, prediction, calibration on this machine, replay in the simulator."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from harness import ROOT
from harness.cli_run import rrfp_in_process
from harness.forked_python import run_python
from harness.launch import child_env
from harness.synthetic_costs import synthetic

from rrfp.core.cost import CostModel, ranking_agreement
from rrfp.core.variability import Variability
from rrfp.sim.replay import replay, replay_durations


def test_fit_recovers_known_costs_and_round_trips():
    truth, rows = synthetic()
    model = CostModel.fit(rows)
    for (s, k), c in truth.items():
        assert np.allclose(model.coef[s][k], c, rtol=1e-6, atol=1e-12), (s, k, model.coef[s][k], c)
    feats = rows[0][2]
    assert model.units(1, 1, feats, split=False) == pytest.approx(
        (model.seconds(1, 1, feats) + model.seconds(1, 2, feats)) / model.reference_s
    )
    assert CostModel.from_json(model.to_json()) == model
    with pytest.raises(ValueError, match="features"):
        CostModel.from_json(json.dumps({"features": ["x"], "coef": [], "reference_s": 1}))


def test_whole_stage_costs_price_an_unsplit_stage_and_round_trip():
    """``whole`` (a fit of every stage unsplit) prices the stages a run leaves unsplit: their F and
    B from it, their W zero; the other stages as split. ``typical`` is the calibration's mean
    microbatch. A file without them (fitted before they were kept) still loads."""
    truth, rows = synthetic()
    split = CostModel.fit(rows)
    whole = CostModel.fit([(s, k, f, 2 * t) for s, k, f, t in rows if k < 2])
    model = split.with_whole(whole)
    assert CostModel.from_json(model.to_json()) == model
    tokens = np.mean([f["tokens"] for s, k, f, _ in rows if k == 0])
    assert model.typical_features()["tokens"] == pytest.approx(tokens)
    run = model.run_whole([1])
    feats = rows[0][2]
    for k in range(2):
        assert run.seconds(1, k, feats) == pytest.approx(whole.seconds(1, k, feats))
        assert run.seconds(0, k, feats) == pytest.approx(split.seconds(0, k, feats))
    assert run.seconds(1, 2, feats) == 0.0
    assert run.seconds(0, 2, feats) == pytest.approx(split.seconds(0, 2, feats))
    assert split.run_whole([1]) == split, "no whole fit: the model was fitted as the run runs"
    old = json.loads(split.to_json())
    del old["typical"]
    assert CostModel.from_json(json.dumps(old)).whole is None
    with pytest.raises(ValueError, match="the whole-stage fit has 1 stages"):
        split.with_whole(CostModel.fit([r for r in rows if r[0] == 0]))


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("whole", [[[0, 0, 0, 0], [0, 0, 0, 0]]], "one entry per stage"),
        ("whole", [[[0, 0, 0, 0]], [[0, 0, 0, 0]]], "whole[0] must hold 2 kinds"),
        ("whole", [[[0, 0, 0, 0], [0, 0, 0]], [[0] * 4] * 2], "whole[0][1] must be 4 finite"),
        ("typical", [1.0, 2.0], "typical must be 3 finite features"),
        ("typical", [1.0, -2.0, 0.0], "typical must be 3 finite features"),
    ],
)
def test_a_bad_whole_or_typical_is_named(key, value, needle):
    doc = json.loads(CostModel.fit(synthetic()[1]).to_json())
    doc[key] = value
    with pytest.raises(ValueError) as e:
        CostModel.from_json(json.dumps(doc))
    assert needle in str(e.value), e.value


def test_ranking_agreement():
    assert ranking_agreement([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert ranking_agreement([3, 2, 1], [10, 20, 30]) == pytest.approx(-1.0)


def test_replay_uses_cost_times_the_presets_noise(tmp_path):
    _, rows = synthetic(stages=2)
    model = CostModel.fit(rows)
    var = Variability.preset("lang")
    feats = [rows[i * 6][2] for i in range(4)]
    dur = replay_durations(model, var, feats, seed=3, step=2, split=True)
    assert dur[1, 2, 0] == pytest.approx(model.units(1, 0, feats[2]) * var.noise(3, 2, 1, 2, 0))
    doc = {
        "pp": 2,
        "n_microbatches": 4,
        "seed": 3,
        "preset": "lang",
        "hint": "bfw",
        "dispatch": "ready",
        "budget": "2x",
        "split": True,
        "unit_ms": 10.0,
        "features": [feats, feats],
        "step_wall_s": [0.5, 0.4],
    }
    out = replay(doc, model)
    assert [step for step, _, _ in out] == [0, 1] and all(sim > 0 for _, sim, _ in out)
    sizes, cost = tmp_path / "sizes.json", tmp_path / "cost.json"
    sizes.write_text(json.dumps(doc))
    cost.write_text(model.to_json())
    p = rrfp_in_process("sim", "--replay", str(sizes), "--cost", str(cost))
    assert p.returncode == 0 and "measured vs simulated after step 1" in p.stdout, p.stderr
    p = rrfp_in_process("sim", "--replay", str(sizes))
    assert p.returncode == 2 and "--replay needs --cost" in p.stderr


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_calibrate_fits_this_machine(tmp_path):
    """`python -m rrfp calibrate` as a child of the preloaded forkserver (its entry, output and
    exit code; a real interpreter runs it from a user's folder in
    tests/app/job/test_own_model_launch.py)."""
    out = tmp_path / "cost.json"
    p = run_python(
        [
            "-m",
            "rrfp",
            "calibrate",
            "--config",
            "configs/gpt-tiny.toml",
            "--pp",
            "2",
            "--samples",
            "4",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        timeout=100,
        env=child_env(),
    )
    assert p.returncode == 0, p.stderr
    assert "median |error|" in p.stdout and "rank agreement" in p.stdout
    # how good the fit is, on microbatches it never saw, with the machine's load beside it
    assert re.search(r"held-out error .* median \|error\| [\d.]+% .* load average", p.stdout)
    quality = json.loads(out.read_text())["quality"]
    assert quality["held_out_median_error"] > 0 and quality["cores"] >= 1
    model = CostModel.from_json(out.read_text())
    assert model.num_stages == 2 and model.reference_s > 0
    # gpt-tiny's bfw splits: every stage is measured unsplit too, for unsplit_stages = "auto"
    assert model.whole is not None and model.typical is not None
    assert re.search(r"split over unsplit.*stage 0 F [\d.]+x, B \+ W [\d.]+x", p.stdout), p.stdout
    # a 4-stage run cannot use a 2-stage model: one clear error before any group
    r = rrfp_in_process(
        "train",
        "--config",
        "configs/gpt-tiny.toml",
        "--set",
        f"cost={out}",
        "--dry-run",
        env={"WORLD_SIZE": "4", "RANK": "0"},
    )
    assert r.returncode == 2 and "calibrated for 2 stages" in r.stderr, r.stderr


def test_calibrate_measures_named_tuple_inputs():
    """The vlm's first-stage inputs are a named tuple (images, ids): calibration moves them as the
    run does and times every task of every stage, image patches counted."""
    from rrfp.app.cli.calibrate_command import measure
    from rrfp.app.config.train_config import TrainConfig

    cfg = TrainConfig.load(str(ROOT / "configs/vlm-tiny.toml"), ["pp=2"], world_size=2)
    rows = measure(cfg, samples=2)  # after two warm-ups: a sample with images and one without
    assert {(stage, kind) for stage, kind, _, _ in rows} == {
        (s, k) for s in range(2) for k in range(3)
    }
    assert all(seconds > 0 for *_, seconds in rows)
    assert any(features["patches"] > 0 for _, _, features, _ in rows)
