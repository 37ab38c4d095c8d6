"""``[parallel] ep``: the layout's EP groups are blocks of adjacent replicas, and a value expert
parallelism does not cover is one ConfigError naming it."""

from __future__ import annotations

import pytest

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError


def test_ep_splits_the_replicas_into_blocks():
    cfg = TrainConfig.load("configs/moe-tiny.toml", ["pp=1", "dp=4", "ep=2"], world_size=4)
    lay = cfg.layout
    assert (lay.dp, lay.ep) == (4, 2)
    assert lay.ep_groups() == [[0, 1], [2, 3]]
    assert lay.expert_dp_groups() == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "sets, world",
    [
        (["pp=1", "dp=2", "ep=4"], 2),
        (["pp=1", "dp=3", "ep=2"], 3),
        (["pp=1", "dp=1", "dp_shard=2", "ep=4"], 2),
        (["pp=1", "tp=2", "dp=1", "ep=2"], 2),
    ],
)
def test_what_expert_parallelism_does_not_cover_is_refused(sets, world):
    with pytest.raises(
        ConfigError, match=r"parallel.ep = \d needs parallel.dp or parallel.dp_shard a multiple"
    ):
        TrainConfig.load("configs/moe-tiny.toml", sets, world_size=world)


def test_ep_splits_fsdp_replicas_as_replicated_ones():
    cfg = TrainConfig.load(
        "configs/moe-tiny.toml", ["pp=1", "dp=1", "dp_shard=4", "ep=2"], world_size=4
    )
    assert (cfg.layout.dp, cfg.layout.ep) == (4, 2)
    assert cfg.layout.ep_groups() == [[0, 1], [2, 3]]
