"""A rank that fails on its own posts how on the failure board before its runtime closes the
process groups: its peers learn of the failure when those groups close, and read the board then,
waiting only a short grace for a post (rrfp/app/job/failure_board.py). A rank that lost a peer
posts after (train_command's _fail): its store may be gone."""

from __future__ import annotations

import pytest
from harness.checkpoint_run import _config
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _order(rank, world):
    import rrfp.app.train.training as training
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    seen: list[str] = []
    post, close = training.post_before_teardown, PipelineRuntime.aclose

    def posting(r, note):
        seen.append(f"post {note}")
        post(r, note)

    async def closing(self):
        seen.append("close")
        await close(self)

    training.post_before_teardown, PipelineRuntime.aclose = posting, closing
    cfg = _config(2, "ready", **{"debug.fault": "raise:step=1:stage=1:task=B0", "timeout_s": 20})
    try:
        run(training.stage_main(cfg))
    except Exception as e:  # noqa: BLE001 - what each rank failed with is the result
        return seen, type(e).__name__
    return seen, None


@pytest.mark.timeout(120)
def test_a_failing_rank_posts_before_its_groups_close():
    results = run_ranks(_order, 2, timeout=100)
    seen, failed = results[1]
    assert failed is not None, "the injected fault should fail rank 1"
    assert seen[:2] == ["post primary", "close"], seen
    # rank 0 lost its peer: it posts after its teardown (its store could be the dead one)
    seen, failed = results[0]
    assert failed is not None and seen == ["close"], (failed, seen)
