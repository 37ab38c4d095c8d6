"""``[parallel] dp_shard``: the layout's replicas are the FSDP replicas, and what FSDP-sharded
stages do not cover is one ConfigError naming it."""

from __future__ import annotations

import pytest

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError


def test_dp_shard_sets_the_layouts_replicas():
    cfg = TrainConfig.load("configs/gpt-tiny.toml", ["pp=2", "dp_shard=2"], world_size=4)
    assert (cfg.layout.pp, cfg.layout.dp, cfg.parallel.dp_shard) == (2, 2, 2)


@pytest.mark.parametrize(
    "sets, world, needle",
    [
        (
            ["pp=1", "dp=2", "dp_shard=2"],
            4,
            r"parallel.dp = 2 and parallel.dp_shard = 2: choose one",
        ),
        (["pp=1", "tp=2", "dp_shard=2"], 4, r"parallel.dp_shard = 2 with parallel.tp = 2"),
        (["pp=2", "dp_shard=2", "checkpoint.dir=/tmp/x"], 4, r"with checkpoint.dir: checkpoints"),
        (["pp=2", "dp_shard=2", "model.tie_embeddings=true"], 4, r"with tied parameters"),
    ],
)
def test_what_fsdp_stages_do_not_cover_is_refused(sets, world, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=world)
