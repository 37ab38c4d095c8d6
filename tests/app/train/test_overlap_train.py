"""``rrfp train`` with ``schedule.overlap = true`` (configs/moe-tiny.toml, pp 2 x dp 2 = ep 2 on 4
gloo ranks): the setting reaches the executor, whose W's beside the all-to-alls change no
gradient, so the run trains as the one without it."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks
from harness.moe_tiny_run import CONFIG, short_run

pytestmark = pytest.mark.multirank

STEPS = 2  # the second step's loss is of the first step's update


def _train(rank, world, overlap):
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    sets = [*short_run(STEPS), "parallel.ep=2", f"schedule.overlap={str(overlap).lower()}"]
    cfg = TrainConfig.load(CONFIG, sets, world_size=world)
    assert cfg.schedule_settings().overlap is overlap
    s = run(stage_main(cfg))
    return s.losses, s.grad_norms


@pytest.mark.timeout(400)
def test_overlap_trains_as_without_it():
    plain = run_ranks(_train, 4, False, timeout=180)[0]
    overlapped = run_ranks(_train, 4, True, timeout=180)[0]
    assert len(overlapped[0]) == STEPS
    # float32, the same products in the same order: equal to rounding
    assert overlapped[0] == pytest.approx(plain[0], rel=1e-5), (plain[0], overlapped[0])
    assert overlapped[1] == pytest.approx(plain[1], rel=1e-4), (plain[1], overlapped[1])
