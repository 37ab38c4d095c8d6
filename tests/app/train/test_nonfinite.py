"""optim.on_nonfinite = "skip": a NaN in one stage's gradients skips that step's
optimizer update on every rank (every stage keeps its weights), and training
goes on. ("stop" is checked through the CLI in test_fault_injection.py.)"""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

STEPS, NAN_STEP = 4, 2  # 1-based, as debug.fault counts


def _train(rank, world):
    import torch

    import rrfp.app.train.training as train
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.loop import run

    cfg = TrainConfig.load(
        "configs/gpt-tiny.toml",
        [
            f"steps={STEPS}",
            "n_microbatches=2",
            "timeout_s=30",
            "model.n_embd=32",
            "model.block_size=64",
            "model.n_layer=2",
            "data.min_seq_len=8",
            "data.max_seq_len=32",
            "on_nonfinite=skip",
            f"fault=nan:step={NAN_STEP}:stage=1",
            "output.dir=",  # no run folder: metrics nobody reads
        ],
        world_size=world,
    )
    before_update = []  # the weights as each step's update is decided (after the gradient sync)
    checked = train._finite

    def recording(module, loss):
        before_update.append([p.detach().clone() for p in module.parameters()])
        return checked(module, loss)

    train._finite = recording
    summary = run(train.stage_main(cfg))
    after = [
        p.detach().clone() for p in before_update[-1]
    ]  # the last step's update is not seen: fine
    changed = [
        any(not torch.equal(a, b) for a, b in zip(before_update[i], before_update[i + 1]))
        for i in range(STEPS - 1)
    ]
    finite = all(torch.isfinite(p).all() for snap in before_update for p in snap) and all(
        torch.isfinite(p).all() for p in after
    )
    return {
        "skipped": summary.skipped,
        "losses": summary.losses,
        "changed": changed,
        "finite": finite,
    }


@pytest.mark.timeout(150)
def test_skip_leaves_every_stage_unchanged_and_goes_on():
    results = run_ranks(_train, 2, timeout=120)
    for rank, out in results.items():
        assert out["skipped"] == [NAN_STEP - 1], f"rank {rank}: {out}"
        # the update after step k shows between the weights seen at step k and at step k + 1
        assert out["changed"] == [True, False, True], (
            f"rank {rank}: only step {NAN_STEP}'s update is skipped: {out}"
        )
        assert out["finite"], f"rank {rank}: a NaN reached the weights"
        assert len(out["losses"]) == STEPS and all(loss == loss for loss in out["losses"]), out[
            "losses"
        ]
    assert results[0]["losses"] == results[1]["losses"], (
        "every rank reports the same all-reduced losses"
    )
