"""``rrfp train`` with ``[parallel] dp_shard = 2`` on pp 2 (4 gloo ranks, float64): each stage is
FSDP2-sharded over its two replicas, and every step's loss and gradient norm (optim.clip_grad_norm,
so the norm counts each rank's shard) match one process training the whole model on the whole
batch of both replicas with torch.nn.utils.clip_grad_norm_ and AdamW."""

from __future__ import annotations

import pytest
from harness.clip_reference import CLIP, SETS, _reference
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _train(rank, world):
    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    torch.set_default_dtype(torch.float64)
    cfg = TrainConfig.load(
        "configs/gpt-tiny.toml", [*SETS, "pp=2", "dp_shard=2", "hint=bfw"], world_size=world
    )
    summary = run(stage_main(cfg))
    # the reference in float64 too, once
    want = _reference(world, 2, None, ["pp=2"]) if rank == 0 else None
    return summary.losses, summary.grad_norms, want


@pytest.mark.timeout(150)
def test_train_with_fsdp_sharded_stages_equals_one_process():
    results = run_ranks(_train, 4, timeout=130)
    losses, norms = results[0][2]
    assert all(n > CLIP for n in norms), "the test must clip"
    for rank, (got_losses, got_norms, _) in results.items():
        assert got_losses == pytest.approx(losses, rel=1e-10), rank
        assert got_norms == pytest.approx(norms, rel=1e-10), rank
