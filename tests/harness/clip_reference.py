"""``rrfp train`` with global clipping on pp 2, and the whole model trained in one process as its
reference: the clip tests and the FSDP ones compare their ranks with it."""

from __future__ import annotations

import math

STEPS, CLIP = 3, 0.05  # the NaN step (2) and one after it: training goes on


SETS = [
    f"steps={STEPS}",
    "n_microbatches=2",
    "timeout_s=30",
    "model.n_embd=16",
    "model.n_head=2",
    "model.block_size=32",
    "model.n_layer=2",
    "data.microbatch_size=2",
    "data.min_seq_len=4",
    "data.max_seq_len=16",
    f"clip_grad_norm={CLIP}",
    "on_nonfinite=skip",
    "output.dir=",  # no run folder: metrics nobody reads
]


def _reference(world: int, dp: int, nan_step: int | None, extra=(), clip: bool = True):
    """The whole model here: (losses, norms), a NaN norm and no update at ``nan_step`` (1-based);
    without ``clip``, each step's norm and no clipping."""
    import torch

    from rrfp.app.config.train_config import TrainConfig

    cfg = TrainConfig.load("configs/gpt-tiny.toml", [*SETS, f"dp={dp}", *extra], world_size=world)
    wl, run = cfg.workload, cfg.run
    torch.manual_seed(run.seed)
    model = wl.build_stage(cfg.model, 0, 1, None)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
    )
    losses, norms = [], []
    for step in range(STEPS):
        batch = wl.batches(cfg.data, step, cfg.schedule.n_microbatches * dp)
        loss = sum(wl.loss_fn(model(x), y) for x, y in batch) / len(batch)
        loss.backward()
        if step + 1 == nan_step:
            norms.append(math.nan)
        else:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms.append(
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
                if clip
                else torch.nn.utils.get_total_norm(grads).item()
            )
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms
