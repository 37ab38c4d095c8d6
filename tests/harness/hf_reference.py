"""Tiny HF causal LMs in float64, the data their end-to-end tests train on, and the one-process
reference: gradient clipping and AdamW with the linear warmup rrfp train applies (torch's LambdaLR
here), shared by
tests/hf/test_hf_train.py and tests/hf/test_hf_schedule.py (torch imported inside: the ranks import
it)."""

from __future__ import annotations

import functools

M, STEPS, LR, WARMUP, CLIP = 4, 3, 1e-2, 2, 0.5  # CLIP: below the first steps' gradient norms
SIZES = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    dtype="float64",
    gradient_checkpointing=True,
)


def model_config(family: str, **kw):
    """Qwen3 ties its embedding and LM head (first and last stage), Llama does not."""
    from rrfp.models.hf import HFConfig

    return HFConfig(family=family, **{**SIZES, "tie_word_embeddings": family == "qwen3", **kw})


def data_config():
    from rrfp.models.data import DataConfig

    return DataConfig(seed=3, microbatch_size=2, min_seq_len=8, max_seq_len=40)


def reference(cfg, data, seed: int = 0, batches=None) -> tuple[list[float], dict, list[float]]:
    """Each step's mean microbatch loss, the final parameters {name: tensor} of the whole model (a
    tied weight under both names), and each step's gradient norm before clipping.
    ``batches(step)``: that step's microbatches (default: rrfp/models/data.py's)."""
    import torch

    from rrfp.models.data import batches as make_batches
    from rrfp.models.hf import build_model, loss_fn

    model = build_model(cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / WARMUP))
    losses, norms = [], []
    for step in range(STEPS):
        mbs = batches(step) if batches is not None else make_batches(data, step, M)
        loss = sum(loss_fn(model(x).logits, y) for x, y in mbs) / len(mbs)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        warmup.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, norms


@functools.cache  # several tests of a process compare with the same family's run
def family_reference(family: str) -> tuple[list[float], dict, list[float]]:
    """``reference`` of ``family``'s tiny model on ``data_config()``'s data (its tensors are
    shared: read them, do not change them)."""
    return reference(model_config(family), data_config())
