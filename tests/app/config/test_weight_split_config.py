"""schedule.weight_split: how a run's split backward leaves weight gradients to W, carried to every
stage worker; the split-aware functions refused where no run has put its linears through their
queue (tensor parallel, FSDP, expert parallel), and auto, the default, resolving to them elsewhere.
"""

from __future__ import annotations

import pytest
from harness import ROOT

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.pipeline.schedule_settings import resolve_weight_split

GPT = str(ROOT / "configs" / "gpt-tiny.toml")


def test_the_default_is_auto_and_functions_reaches_the_settings():
    assert TrainConfig.load(
        GPT, ["parallel.pp=2"], world_size=2
    ).schedule_settings().weight_split == ("auto")
    cfg = TrainConfig.load(GPT, ["parallel.pp=2", "schedule.weight_split=functions"], world_size=2)
    assert cfg.schedule_settings().weight_split == "functions"


@pytest.mark.parametrize(
    "chosen, wider, mode",
    [
        ("auto", [], "functions"),
        ("auto", ["parallel.tp = 2"], "autograd"),
        ("auto", ["FSDP-sharded stages (parallel.dp_shard)"], "autograd"),
        ("auto", ["parallel.ep = 2"], "autograd"),
        ("autograd", [], "autograd"),
        ("functions", [], "functions"),
    ],
)
def test_auto_resolves_to_functions_unless_a_wider_parallelism_runs(chosen, wider, mode):
    got, why = resolve_weight_split(chosen, wider)
    assert got == mode
    assert all(w in why for w in wider)


def test_auto_is_accepted_with_wider_parallelism():
    cfg = TrainConfig.load(GPT, ["parallel.pp=2", "parallel.tp=2"], world_size=4)
    assert cfg.schedule_settings().weight_split == "auto"


@pytest.mark.parametrize(
    "sets, world, needle",
    [
        (["parallel.tp=2"], 4, "parallel.tp = 2"),
        (["parallel.dp_shard=2"], 4, "parallel.dp_shard = 2"),
    ],
)
def test_functions_is_refused_with_wider_parallelism_in_one_line(sets, world, needle):
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(
            GPT, ["parallel.pp=2", "schedule.weight_split=functions", *sets], world_size=world
        )
    assert needle in str(e.value) and "schedule.weight_split = autograd or auto" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="weight_split"):
        TrainConfig.load(GPT, ["parallel.pp=2", "schedule.weight_split=layers"], world_size=2)
