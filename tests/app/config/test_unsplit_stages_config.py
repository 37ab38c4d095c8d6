"""schedule.unsplit_stages: carried to the executor's settings and to calibration; a value that
names no stage of the layout, a schedule that does not split, or emulated time is one ConfigError
line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import ROOT
from harness.synthetic_costs import cost_file

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.core.cost import CostModel

GPT = str(ROOT / "configs" / "gpt-tiny.toml")  # 4 stages, bfw: a split backward


def test_empty_by_default_and_set_reaches_the_settings():
    assert TrainConfig.load(GPT, [], world_size=4).schedule_settings().unsplit_stages == ()
    cfg = TrainConfig.load(GPT, ["schedule.unsplit_stages=[-1, 1]"], world_size=4)
    assert cfg.schedule_settings().unsplit_stages == (-1, 1)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["schedule.unsplit_stages=[4]"], "out of range for 4 stages"),
        (["schedule.unsplit_stages=[0, -4]"], "names a stage twice"),
        (["schedule.unsplit_stages=[-1]", "schedule.hint=1f1b"], "needs a split backward"),
        (["schedule.unsplit_stages=[-1]", "schedule.split=false"], "needs a split backward"),
        (["schedule.unsplit_stages=[-1]", "emulation.unit_ms=2"], "real compute"),
        (['schedule.unsplit_stages=["last"]'], "not a list of stage numbers"),
        (["schedule.unsplit_stages=3"], "wrong type"),
    ],
)
def test_what_it_cannot_mean_is_one_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(GPT, sets, world_size=4)
    msg = str(e.value)
    assert "schedule.unsplit_stages" in msg and needle in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("weight_split, mode", [("auto", "functions"), ("autograd", "autograd")])
def test_calibration_measures_the_stages_as_the_run_runs_them(monkeypatch, weight_split, mode):
    """`rrfp calibrate` (and the bench's calibration) prices each stage as it will run: split as
    the run resolves schedule.weight_split, and whole where the config leaves it unsplit."""
    from rrfp.app.cli import calibrate_command
    from rrfp.pipeline import calibration

    built = {}
    real = calibration.StageWorker

    def spy(module, stage, *args, **kwargs):
        built[stage] = (kwargs.get("whole", False), kwargs.get("weight_split"))
        return real(module, stage, *args, **kwargs)

    monkeypatch.setattr(calibration, "StageWorker", spy)
    sets = [
        "schedule.unsplit_stages=[-1]",
        "model.n_layer=4",
        f"schedule.weight_split={weight_split}",
    ]
    cfg = TrainConfig.load(GPT, sets, world_size=4)
    samples = calibrate_command.measure(cfg, 1)
    assert built == {0: (False, mode), 1: (False, mode), 2: (False, mode), 3: (True, mode)}
    assert {(s, k) for s, k, _, _ in samples} == {(s, k) for s in range(4) for k in range(3)}


@pytest.mark.parametrize("hint, budget", [("plan", "4"), ("bfw", "2x")])
def test_auto_leaves_unsplit_the_stage_that_pays_and_prices_it_whole(tmp_path, hint, budget):
    sets = [
        'schedule.unsplit_stages="auto"',
        f"schedule.hint={hint}",
        f"schedule.budget={budget}",
        f"emulation.cost={cost_file(tmp_path)}",
    ]
    cfg = TrainConfig.load(GPT, sets, world_size=4)
    assert cfg.unsplit_stages == (3,)
    settings = cfg.schedule_settings()
    assert settings.unsplit_stages == (3,)
    # the plan prices the unsplit stage's B whole and its W at nothing; the rest as split
    assert settings.cost.coef[3][1][0] == 2.0 and settings.cost.coef[3][2][0] == 0.0
    assert settings.cost.coef[0] == cfg.emulation.cost.coef[0]


def test_named_stages_are_priced_whole_by_a_model_fitted_both_ways(tmp_path):
    cfg = TrainConfig.load(
        GPT, ["schedule.unsplit_stages=[-1, 0]", f"emulation.cost={cost_file(tmp_path)}"], 4
    )
    coef = cfg.schedule_settings().cost.coef
    assert [coef[s][2][0] for s in range(4)] == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "sets, needle",
    [
        (['schedule.unsplit_stages="auto"', "schedule.hint=1f1b"], "needs a split backward"),
        (['schedule.unsplit_stages="auto"', "emulation.unit_ms=2"], "real compute"),
        (['schedule.unsplit_stages="last"'], 'nor "auto"'),
    ],
)
def test_what_auto_cannot_mean_is_one_line(sets, needle):
    test_what_it_cannot_mean_is_one_line(sets, needle)


def test_auto_without_whole_costs_or_any_cost_model_is_one_line(tmp_path):
    old = json.loads(CostModel.from_json(Path(cost_file(tmp_path)).read_text()).to_json())
    del old["whole"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    sets = ['schedule.unsplit_stages="auto"', f"emulation.cost={path}"]
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(GPT, sets, world_size=4)
    assert "calibrate a split schedule again" in str(e.value) and "\n" not in str(e.value)
    # no cost model: refused on every rank before any group, as hint plan is
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(GPT, ['schedule.unsplit_stages="auto"'], world_size=4)
    assert "no costs to choose by" in str(e.value) and "\n" not in str(e.value)
    # a model of other stages: the stage count's own line
    with pytest.raises(ConfigError, match="calibrated for 2 stages"):
        TrainConfig.load(
            GPT,
            ['schedule.unsplit_stages="auto"', f"emulation.cost={cost_file(tmp_path, 2, 1)}"],
            4,
        )


def test_auto_calibrates_every_stage_split_and_every_stage_whole(monkeypatch, tmp_path):
    """Recalibrating a run that chooses: its chosen stages are not measured whole, every stage is
    measured split and again whole."""
    cost = cost_file(tmp_path)
    from rrfp.app.cli import calibrate_command
    from rrfp.pipeline import calibration

    built = []
    real = calibration.StageWorker

    def spy(module, stage, *args, **kwargs):
        built.append((stage, kwargs.get("whole", False)))
        return real(module, stage, *args, **kwargs)

    monkeypatch.setattr(calibration, "StageWorker", spy)
    sets = ['schedule.unsplit_stages="auto"', "model.n_layer=4", f"emulation.cost={cost}"]
    cfg = TrainConfig.load(GPT, sets, 4)
    calibrate_command.measure(cfg, 1)
    assert built == [(s, False) for s in range(4)]
    built.clear()
    samples = calibrate_command.measure(cfg, 1, whole=True)
    assert built == [(s, True) for s in range(4)]
    assert {(s, k) for s, k, _, _ in samples} == {(s, k) for s in range(4) for k in range(3)}
