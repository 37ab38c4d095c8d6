"""Build a HF causal LM's stage (or, for a one-process reference, the whole model) from its config.

The model is built on the meta device, so no stage allocates the layers it does not keep; the
stage's part is then materialised and initialised module by module. Each module's weights come
from a generator seeded by ``(seed, the module's name in the whole model)``, so a stage built
alone holds exactly the tensors of the whole model built by ``build_hf_model`` from the same
seed, whatever the split. The rotary ``inv_freq`` buffers, which are not saved in checkpoints,
are recomputed from the config. With a tied LM head on a last stage that lacks the embedding,
the head starts as the embedding would: the same seed, the embedding's init. A mixture of experts
with ``output_router_logits`` gets its balance loss per layer (rrfp/hf/router_aux_loss.py), in the
whole model as in each stage.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from rrfp.hf.extra import require
from rrfp.hf.families import check_config
from rrfp.hf.layers import hf_layer_ranges
from rrfp.hf.router_aux_loss import add_router_aux_losses, moe_blocks
from rrfp.hf.router_steps import count_routes
from rrfp.hf.safetensors_load import load_stage_tensors
from rrfp.hf.stage import HFStage

log = logging.getLogger("rrfp.hf")

EMBED, HEAD = "model.embed_tokens", "lm_head"


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s initial weights: a function of the run's seed and the name
    only."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _meta_model(config, dtype: torch.dtype | None, gradient_checkpointing: bool) -> nn.Module:
    transformers = require("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model.to(dtype)
    if (
        gradient_checkpointing
    ):  # HF's own per-layer switch; non-reentrant works under the split backward
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _initialise(
    init_fn, modules: Iterable[tuple[str, nn.Module]], seed: int, skip: set[str]
) -> None:
    """HF's ``_init_weights`` on every module that holds tensors, each under its own seed."""
    for name, module in modules:
        if name in skip or not (
            list(module.parameters(recurse=False)) or list(module.buffers(recurse=False))
        ):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, name))
            init_fn(module)


def _fill_nan(module: nn.Module) -> None:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))


def _check_initialised(module: nn.Module, what: str) -> None:
    """An initialiser that missed a tensor leaves its NaN: name it rather than train on it."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_floating_point() and bool(torch.isnan(t).any()):
            raise RuntimeError(
                f"{what}: {name} was not initialised (HF's _init_weights does not cover "
                f"{type(t).__name__} of this module)"
            )


def build_hf_model(
    config, *, seed: int = 0, dtype: torch.dtype | None = None, gradient_checkpointing: bool = False
) -> nn.Module:
    """The whole ``*ForCausalLM`` on the CPU, initialised as ``build_hf_stage`` initialises its
    stages: the one-process reference of a pipeline built from the same seed."""
    check_config(config)
    model = _meta_model(config, dtype, gradient_checkpointing)
    model.to_empty(device="cpu")
    if _tied(config):
        model.lm_head.weight = model.model.embed_tokens.weight
    _fill_nan(model)
    _initialise(
        model._init_weights, model.named_modules(), seed, skip={HEAD} if _tied(config) else set()
    )
    _check_initialised(model, "the whole model")
    blocks = moe_blocks(model.model.layers)
    count_routes(blocks)
    add_router_aux_losses(blocks, config, len(blocks))
    return model.train()


def build_hf_stage(
    config,
    stage: int,
    num_stages: int,
    *,
    layers: Sequence | None = None,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    checkpoint: str | Path | None = None,
    gradient_checkpointing: bool = False,
) -> HFStage:
    """Stage ``stage`` of ``num_stages`` of the causal LM ``config`` describes, on the CPU (under
    ``torch.device("meta")``: left on the meta device, uninitialised, for its sizes).

    ``layers``: one layer range per stage (``range`` or ``(start, stop)``); default balanced by
    count. ``checkpoint``: a ``.safetensors`` file, or a folder with one or with a sharded
    ``model.safetensors.index.json``: only this stage's tensors are read. Without it the weights
    are the seeded init (``build_hf_model``'s). ``gradient_checkpointing``: HF's activation
    checkpointing on each decoder layer (non-reentrant)."""
    check_config(config)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must be an integer in [0, {num_stages}), got {stage!r}")
    mine = hf_layer_ranges(config.num_hidden_layers, num_stages, layers)[stage]
    full = _meta_model(config, dtype, gradient_checkpointing)
    first, last = stage == 0, stage == num_stages - 1
    body = full.model
    module = HFStage(
        config,
        stage,
        num_stages,
        mine,
        embed_tokens=body.embed_tokens if first else None,
        decoder_layers={i: body.layers[i] for i in mine},
        norm=body.norm if last else None,
        lm_head=full.lm_head if last else None,
        rotary_emb=body.rotary_emb,
    )
    if (
        torch.get_default_device().type == "meta"
    ):  # sizes only (rrfp train's memory check): nothing to fill
        return module.train()
    module.to_empty(device="cpu")
    tied_here = _tied(config) and first and last
    if tied_here:
        module.lm_head.weight = module.model.embed_tokens.weight
    _fill_nan(module)
    skip = {HEAD} if _tied(config) else set()
    if checkpoint is None:
        _initialise(full._init_weights, module.named_modules(), seed, skip)
        if _tied(config) and last and not first:
            _init_head_as_embedding(full, module.lm_head, seed)
    else:
        _initialise(
            full._init_weights,
            ((n, m) for n, m in module.named_modules() if n.endswith("rotary_emb")),
            seed,
            skip,
        )
        load_stage_tensors(module, checkpoint, tied=_tied(config))
    _check_initialised(module, f"stage {stage}")
    blocks = moe_blocks(module.model.layers.values())
    count_routes(blocks)
    add_router_aux_losses(blocks, config, len(moe_blocks(body.layers)))
    log.debug(
        "stage %d of %d: layers %d..%d, %d parameters",
        stage,
        num_stages,
        mine.start,
        mine.stop - 1,
        sum(p.numel() for p in module.parameters()),
    )
    return module.train()


def _init_head_as_embedding(full: nn.Module, head: nn.Module, seed: int) -> None:
    """A tied head away from the embedding starts equal to it: the embedding's init under its
    seed."""
    src = full.model.embed_tokens
    scratch = nn.Embedding(
        src.num_embeddings, src.embedding_dim, src.padding_idx, dtype=head.weight.dtype
    )
    _initialise(full._init_weights, [(EMBED, scratch)], seed, set())
    with torch.no_grad():
        head.weight.copy_(scratch.weight)
