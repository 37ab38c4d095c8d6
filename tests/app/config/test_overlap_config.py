"""schedule.overlap: a ready W beside an EP task's all-to-all, carried to the executor's settings;
a run it cannot apply to (fixed dispatch, an unsplit backward, no expert parallelism, a CUDA
stream) is one ConfigError line naming what it needs."""

from __future__ import annotations

import pytest
from harness import ROOT

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError

MOE = str(ROOT / "configs" / "moe-tiny.toml")
EP2 = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"]


def test_off_by_default_and_on_reaches_the_settings():
    assert not TrainConfig.load(MOE, EP2, world_size=4).schedule_settings().overlap
    cfg = TrainConfig.load(MOE, [*EP2, "schedule.overlap=true"], world_size=4)
    assert cfg.schedule_settings().overlap


@pytest.mark.parametrize(
    "sets, world, needle",
    [
        ([*EP2, "schedule.dispatch=fixed"], 4, "schedule.dispatch = ready"),
        ([*EP2, "schedule.split=false"], 4, "a split backward"),
        (["parallel.pp=2", "parallel.dp=2"], 4, "parallel.ep > 1"),
    ],
)
def test_a_run_it_cannot_apply_to_is_one_line(sets, world, needle):
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(MOE, [*sets, "schedule.overlap=true"], world_size=world)
    msg = str(e.value)
    assert msg.startswith("schedule.overlap = true needs") and needle in msg, msg
    assert "\n" not in msg


def test_a_value_that_is_not_a_bool_is_refused():
    with pytest.raises(ConfigError, match="overlap"):
        TrainConfig.load(MOE, [*EP2, "schedule.overlap=3"], world_size=4)
