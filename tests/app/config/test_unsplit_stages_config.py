"""schedule.unsplit_stages: carried to the executor's settings and to calibration; a value that
names no stage of the layout, a schedule that does not split, or emulated time is one ConfigError
line naming the key."""

from __future__ import annotations

import pytest
from harness import ROOT

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError

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
