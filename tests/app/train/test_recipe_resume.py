"""A run with the whole recipe on (cosine schedule after a warmup, weight-decay groups, clipping,
per-block activation checkpointing, dropout, evaluation every 2 steps), resumed from its step-3
checkpoint, ends as the unbroken run does: the same losses, gradient norms and evaluation losses,
and bit for bit the same final model, optimizer state (AdamW's moments, SGD's momentum) and
generators."""

from __future__ import annotations

import shutil

import pytest
from harness.checkpoint_state import differing, final_state
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

# saved after the warmup and between two evaluations, one step resumed: it crosses the schedule's
# position, the optimizer state, the generators and the evaluation's cadence, whatever the count
STEPS, SAVED = 4, 3
SETS = [
    f"steps={STEPS}",
    "n_microbatches=2",
    "timeout_s=30",
    "model.n_embd=16",
    "model.n_head=2",
    "model.block_size=32",
    "model.n_layer=2",
    "model.dropout=0.1",
    "data.microbatch_size=2",
    "data.min_seq_len=4",
    "data.max_seq_len=16",
    "clip_grad_norm=0.5",
    "weight_decay=0.1",
    "schedule=cosine",
    "min_lr=3e-4",
    "warmup_steps=2",
    "activation_checkpointing=layers",
    "eval.every=2",
    "eval.batches=1",
    f"checkpoint.every={SAVED}",
    "checkpoint.keep=5",
    "output.dir=",  # no run folder: metrics nobody reads
]


def _train(rank, world, ckdir, name, resume):
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    sets = [*SETS, f"checkpoint.dir={ckdir}", f"optim.name={name}", f"checkpoint.resume={resume}"]
    cfg = TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=world)
    s = run(stage_main(cfg))
    return s.first_step, s.losses, s.grad_norms, s.eval_losses


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_resumed_recipe_run_ends_as_the_unbroken_one(tmp_path, name):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    a = run_ranks(_train, 2, whole, name, "off", timeout=90)[0]
    broken.mkdir()
    shutil.copytree(whole / f"step-{SAVED:08d}", broken / f"step-{SAVED:08d}")
    b = run_ranks(_train, 2, broken, name, "required", timeout=90)[0]
    assert a[0] == 0 and b[0] == SAVED, (a[0], b[0])
    assert b[1] == a[1][SAVED:] and len(b[1]) == STEPS - SAVED, (a[1], b[1])
    assert b[2] == a[2][SAVED:], (a[2], b[2])
    evaluated = list(range(2, STEPS + 1, 2))  # eval.every = 2
    assert sorted(a[3]) == evaluated, a[3]
    assert b[3] == {s: a[3][s] for s in evaluated if s > SAVED}, (a[3], b[3])
    x, y = final_state(whole, STEPS), final_state(broken, STEPS)
    moments = ".exp_avg_sq" if name == "adamw" else ".momentum_buffer"
    assert x.keys() == y.keys() and any(moments in k for k in x) and any(".rng" in k for k in x)
    differ = differing(x, y)
    assert not differ, f"the resumed run's final state differs in {differ[:5]}"
