"""How much of each stage's weight-gradient work the split backward moves to W.

For every stage of the GPT and the VLM (the workloads' own configs and data,
4 stages) and for a GRU stage and a cross-attention stage of plain torch
modules, one microbatch runs F, B and W through the stage worker. The share is
the worker's own statistic (``StageWorker.split_summary``): W's FLOPs over all
weight-gradient FLOPs, counted by torch.utils.flop_counter (matmuls,
convolutions, attention; elementwise work is not counted). Next to it, the
parameters whose gradient stays in B, and why. Counted, not timed: the figures
do not depend on the machine.

    .venv/bin/python benchmarks/weight_share.py
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import rrfp
from rrfp.models import gpt, vlm

STAGES = 4


def workload_stages(config: str):
    """(name, module, stage, input, targets) for each stage of a config's workload, inputs from
    the stages before it."""
    cfg = rrfp.TrainConfig.load(config, world_size=STAGES)
    w, model_cfg, data_cfg = cfg.workload, cfg.model, cfg.data
    torch.manual_seed(0)
    mods = [w.build_stage(model_cfg, s, STAGES, None) for s in range(STAGES)]
    x, y = w.batches(data_cfg, 0, 1)[0]
    for s, m in enumerate(mods):
        yield f"{w.name} stage {s}", m, s, x, y
        with torch.no_grad():
            x = m(x)


class GRUStage(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(d, d, num_layers=2, batch_first=True), nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.gru(x)[0])


class CrossAttentionStage(nn.Module):
    """Text attends to image features: the packed in-projection serves q and (k, v) separately."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.attn, self.norm = nn.MultiheadAttention(d, 4, batch_first=True), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, inputs):
        text, image = inputs
        h = text + self.attn(self.norm(text), image, image, need_weights=False)[0]
        return h + self.mlp(self.norm(h)), image


def plain_stages():
    torch.manual_seed(0)
    x = torch.randn(8, 32, 64)
    yield "GRU (2 layers, 32 steps), middle", GRUStage(), 1, x, None
    yield "cross-attention, middle", CrossAttentionStage(), 1, (x, torch.randn(8, 16, 64)), None


def share(module, stage, x, targets, loss_fn):
    last = stage == STAGES - 1
    w = rrfp.StageWorker(module, stage, STAGES, 1, loss_fn, split=True, measure_activations=False)
    out = w.forward(0, x, targets if last else None)
    grad = (
        None
        if last
        else (
            tuple(
                None if t is None or not t.is_floating_point() else torch.randn_like(t) for t in out
            )
            if isinstance(out, tuple)
            else torch.randn_like(out)
        )
    )
    w.backward(0, grad)
    w.weight(0)
    return w.split_summary()


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    rows = [
        *workload_stages("configs/gpt-tiny.toml"),
        *workload_stages("configs/vlm-tiny.toml"),
        *plain_stages(),
    ]
    print(f"{'stage':<36} {'W share':>8}  parameters in B (of all)")
    for name, module, stage, x, y in rows:
        loss_fn = (
            gpt.loss_fn
            if name.startswith("gpt")
            else vlm.loss_fn
            if name.startswith("vlm")
            else None
        )
        s = share(module, stage, x, y, loss_fn)
        pct = "n/a" if s.w_share is None else f"{s.w_share:.1%}"
        kept = ", ".join(f"{n} ({why})" for n, why in s.in_b.items()) or "none"
        print(f"{name:<36} {pct:>8}  {len(s.in_b)} of {s.params}: {kept}")


if __name__ == "__main__":
    main()
