"""Activation checkpointing under the split backward, on a 2-layer Llama stage, side by side.

The stage is a middle stage of HF transformers' LlamaModel (its decoder layers, rotary embedding
and final norm from a small config; hidden states in, hidden states out), checkpointed with HF's
``gradient_checkpointing_enable`` (torch.utils.checkpoint, use_reentrant=False) or not, its
backward split (B, then W) or not. Every mode runs the same stage on the same microbatch, in
alternating order per repetition; the report gives the median F, B and W per microbatch, CPU wall
time, and B + W against the unsplit backward with the same checkpointing. "ungrouped" runs W's
autograd calls without their shared GraphExecGroup: each call then recomputes the checkpointed
regions it reaches.

    .venv/bin/python benchmarks/checkpoint_split.py [--hidden 256 --seq 128 --batch 4 --reps 11]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import LlamaConfig, LlamaModel

from rrfp import StageWorker


class LlamaStage(nn.Module):
    """Hidden states through the model's decoder layers (no embedding lookup: a middle stage)."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h):
        return self.model(inputs_embeds=h, use_cache=False).last_hidden_state


MODES = [(ckpt, kind) for ckpt in (False, True) for kind in ("unsplit", "split")] + [
    (True, "ungrouped")
]


class NoGroup(contextlib.nullcontext):
    """The ablation: torch's GraphExecGroup that groups nothing (torch's own unpack hook still
    asks it)."""

    _get_current_group = torch.utils.checkpoint.GraphExecGroup._get_current_group


def one(w: StageWorker, kind: str, x, g) -> tuple[float, float, float]:
    """One microbatch's F, B and W on a worker that has run one before (its first counts FLOPs)."""
    split = kind != "unsplit"
    w.reset()
    group = torch.utils.checkpoint.GraphExecGroup  # the ablation: W's calls without it
    if kind == "ungrouped":
        torch.utils.checkpoint.GraphExecGroup = NoGroup
    try:
        t0 = time.perf_counter()
        w.forward(0, x)
        t1 = time.perf_counter()
        w.backward(0, g)
        t2 = time.perf_counter()
        if split:
            w.weight(0)
        t3 = time.perf_counter()
    finally:
        torch.utils.checkpoint.GraphExecGroup = group
    w.module.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 8 // 3,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8,
        max_position_embeddings=a.seq,
        attn_implementation="sdpa",
    )
    stages = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = LlamaModel(cfg).train()
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        stages[ckpt] = LlamaStage(model)
    x = torch.randn(a.batch, a.seq, a.hidden)
    g = torch.randn(a.batch, a.seq, a.hidden)
    workers = {
        m: StageWorker(
            stages[m[0]], 1, 3, 1, None, split=m[1] != "unsplit", measure_activations=False
        )
        for m in MODES
    }
    times = {m: [] for m in MODES}
    for rep in range(a.reps + 1):  # the first repetition warms up
        for m in MODES if rep % 2 else MODES[::-1]:
            t = one(workers[m], m[1], x, g)
            if rep:
                times[m].append(t)
    print(
        f"LlamaModel stage: 2 decoder layers, hidden {a.hidden}, batch {a.batch} x {a.seq} "
        f"tokens, CPU {a.threads} thread(s), wall time, median of {a.reps} alternating "
        "repetitions, per microbatch"
    )
    print("| checkpointing | backward | F ms | B ms | W ms | B+W ms | B+W / unsplit |")
    print("|---|---|---|---|---|---|---|")
    for ckpt, kind in MODES:
        base = statistics.median(t[1] for t in times[(ckpt, "unsplit")])
        f, b, w = (statistics.median(t[i] for t in times[(ckpt, kind)]) for i in range(3))
        print(
            f"| {'non-reentrant' if ckpt else 'none'} | {kind} | {f * 1e3:.1f} | {b * 1e3:.1f} | "
            f"{w * 1e3:.1f} | {(b + w) * 1e3:.1f} | {(b + w) / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
