"""``rrfp train`` with the whole recipe on (AdamW over weight-decay groups with a tied embedding,
warmup then cosine decay, global clipping, per-block activation checkpointing under the split
backward, evaluation every 2 steps), on 4 gloo ranks in float64: every loss, gradient norm and
evaluation loss equals one process training the whole model with the same groups, optimizer and
schedule, written out here by hand."""

from __future__ import annotations

import math

import pytest
from harness.distributed import run_ranks

from rrfp.models import data

pytestmark = pytest.mark.multirank

STEPS, CLIP, LR, MIN_LR, WD, WARMUP, EVERY, HELD_OUT = 4, 0.05, 3e-3, 3e-4, 0.1, 1, 2, 2
SETS = [
    f"steps={STEPS}",
    "n_microbatches=4",
    "timeout_s=30",
    "model.n_embd=16",
    "model.n_head=2",
    "model.block_size=32",
    "model.n_layer=4",
    "model.tie_embeddings=true",
    "data.microbatch_size=2",
    "data.min_seq_len=4",
    "data.max_seq_len=16",
    f"lr={LR}",
    f"clip_grad_norm={CLIP}",
    f"weight_decay={WD}",
    "schedule=cosine",
    f"min_lr={MIN_LR}",
    f"warmup_steps={WARMUP}",
    "activation_checkpointing=layers",
    f"eval.every={EVERY}",
    f"eval.batches={HELD_OUT}",
    "output.dir=",  # no run folder: metrics nobody reads
]


def _lr(step: int) -> float:
    if step < WARMUP:
        return LR * step / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def _reference():
    """The whole model here: (losses, norms, {step: eval loss})."""
    import torch

    from rrfp.app.config.train_config import TrainConfig

    torch.set_default_dtype(torch.float64)
    cfg = TrainConfig.load("configs/gpt-tiny.toml", SETS, world_size=4)
    wl, run, m = cfg.workload, cfg.run, cfg.schedule.n_microbatches
    torch.manual_seed(run.seed)
    model = wl.build_stage(cfg.model, 0, 1, None)
    assert model.lm_head.weight is model.transformer.wte.weight
    # nanoGPT's groups: matrices decay; norms, biases and the (tied) embeddings do not
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    rest = [p for p in params if p.dim() < 2 or id(p) in embeddings]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    # the stdlib bytes after the training corpus (rrfp/models/data.py), which training never draws
    held_out = [b for k in range(HELD_OUT) for b in data.eval_batches(cfg.data, k, m)]
    losses, norms, evals = [], [], {}
    for step in range(STEPS):
        batch = wl.batches(cfg.data, step, m)
        loss = sum(wl.loss_fn(model(x), y) for x, y in batch) / len(batch)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % EVERY == 0 or step + 1 == STEPS:
            with torch.no_grad():
                evals[step + 1] = sum(wl.loss_fn(model(x), y).item() for x, y in held_out) / len(
                    held_out
                )
    return losses, norms, evals


def _train(rank, world):
    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    torch.set_default_dtype(torch.float64)
    cfg = TrainConfig.load("configs/gpt-tiny.toml", SETS, world_size=world)
    summary = run(stage_main(cfg))
    return summary.losses, summary.grad_norms, summary.eval_losses


@pytest.mark.timeout(200)
def test_recipe_at_pp4_matches_one_process():
    want_losses, want_norms, want_evals = _reference()
    assert all(n > CLIP for n in want_norms), "the test must clip"
    assert sorted(want_evals) == [2, 4]
    for rank, (losses, norms, evals) in run_ranks(_train, 4, timeout=180).items():
        assert sorted(evals) == sorted(want_evals), (rank, evals)
        gaps = {
            "loss": max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)),
            "grad norm": max(abs(a - b) / b for a, b in zip(norms, want_norms, strict=True)),
            "eval loss": max(abs(evals[s] - want_evals[s]) for s in want_evals),
        }
        print(f"rank {rank}: largest differences from one process: {gaps}")
        assert all(gap < 1e-10 for gap in gaps.values()), (rank, gaps, losses, want_losses)
