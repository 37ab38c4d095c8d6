"""A nanoGPT-style GPT whose linears are SplitLinear, and its pipeline split.

The full model is built once from a seed (same init whatever the split), then
`make_stage` keeps a stage's part of it, torchtitan style: the stage is the full
model with the other layers removed, so parameter names stay those of the full
model (``transformer.h.3.mlp.c_fc.weight``) and gradients compare by name.

With ``tie_embeddings`` the lm head and the token embedding are one parameter; under pipeline
parallelism they live on different stages, each holding a copy, and ``tied`` declares the pair
to rrfp, which keeps the copies equal (their gradients summed after every iteration).

Tensor parallelism (``make_stage(..., tp_group=g)``, Megatron style): in every
block of the stage, attn.c_attn and mlp.c_fc become column-parallel, attn.c_proj
and mlp.c_proj row-parallel, and attention runs on n_head/tp local heads. The
fused q|k|v weight [3C, C] is sharded per block, so a rank holds the q, k and v
rows of its own heads. Embeddings, layernorms and the lm head stay replicated
(whole on every TP rank, with identical gradients). Sharded parameters keep the
full model's names; `full_grad_slice` gives the matching slice of a full tensor.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rrfp import (
    ColumnParallelLinear,
    RowParallelLinear,
    SplitLinear,
    Workload,
    group_size_rank,
    shard_from_full,
)
from rrfp.models.data import DataConfig, batches, check_fits, describe, eval_batches

log = logging.getLogger(__name__)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    is_causal = True  # a vision encoder's attention (models/vlm.py) sees every patch

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = SplitLinear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = SplitLinear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.c_attn(x)  # [b, t, 3 * c_local]; c_local = n_embd / tp, n_head the local heads
        c_local = qkv.size(-1) // 3
        q, k, v = qkv.split(c_local, dim=2)
        q, k, v = (
            z.view(b, t, self.n_head, c_local // self.n_head).transpose(1, 2) for z in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.is_causal
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c_local)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = SplitLinear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = SplitLinear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _embed(transformer: nn.ModuleDict, idx: torch.Tensor, block_size: int) -> torch.Tensor:
    t = idx.size(1)
    if t > block_size:
        raise ValueError(f"sequence length {t} exceeds block_size {block_size}")
    pos = torch.arange(t, device=idx.device)
    return transformer.drop(transformer.wte(idx) + transformer.wpe(pos))


class GPT(nn.Module):
    """The whole model on one process: idx [b, T] -> logits [b, T, vocab]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = SplitLinear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        log.debug("GPT with %d parameters", sum(p.numel() for p in self.parameters()))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, SplitLinear)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = _embed(self.transformer, idx, self.config.block_size)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens of a microbatch (targets of -100, e.g. image tokens, are
    ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def split_layers(n_layer: int, num_stages: int) -> list[range]:
    """Balanced contiguous block ranges; the first n_layer % num_stages stages get one more."""
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"num_stages must be in [1, n_layer={n_layer}], got {num_stages}")
    base, extra = divmod(n_layer, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


# -- tensor parallelism -----------------------------------------------------------

# block-relative module path -> (TP layer class, chunks along the sharded dim)
_TP_PLAN: dict[str, tuple[type, int]] = {
    "attn.c_attn": (ColumnParallelLinear, 3),  # fused q|k|v: each rank its heads' q, k, v rows
    "attn.c_proj": (RowParallelLinear, 1),
    "mlp.c_fc": (ColumnParallelLinear, 1),
    "mlp.c_proj": (RowParallelLinear, 1),
}
_TP_NAME = re.compile(
    r"(?:^|\.)h\.\d+\.(" + "|".join(re.escape(k) for k in _TP_PLAN) + r")\.(weight|bias)$"
)


def validate_tp(cfg: GPTConfig, tp: int) -> None:
    """Raise ValueError unless the model can be split over `tp` tensor-parallel ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if cfg.n_head % tp:
        raise ValueError(f"tp={tp} does not divide n_head={cfg.n_head}")
    if (4 * cfg.n_embd) % tp:
        raise ValueError(f"tp={tp} does not divide 4*n_embd={4 * cfg.n_embd}")


def tp_shard_spec(name: str) -> tuple[int, int] | None:
    """(sharded dim, chunks) of a full-model parameter name under TP; None if replicated."""
    m = _TP_NAME.search(name)
    if m is None:
        return None
    cls, chunks = _TP_PLAN[m.group(1)]
    dim = cls.shard_dims[m.group(2)]
    return None if dim is None else (dim, chunks)


def full_grad_slice(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The part of full-model tensor `name` (a parameter or its gradient) that TP rank
    `tp_rank` of `tp` holds: a slice for sharded parameters, the whole for replicated."""
    spec = tp_shard_spec(name)
    if spec is None or tp == 1:
        return full
    dim, chunks = spec
    return shard_from_full(full, dim, tp_rank, tp, chunks)


def _to_tensor_parallel(block: Block, index: int, group, n_head: int, tp: int) -> None:
    for path, (cls, chunks) in _TP_PLAN.items():
        parent_name, attr = path.split(".")
        parent = getattr(block, parent_name)
        full = getattr(parent, attr)
        setattr(
            parent,
            attr,
            cls.from_full(full, group, chunks=chunks, name=f"transformer.h.{index}.{path}"),
        )
    block.attn.n_head = n_head // tp


class GPTStage(nn.Module):
    """Stage `stage` of `num_stages`: the full model with the other layers removed.

    First stage: idx [b, T] -> hidden [b, T, C] (embeddings + its blocks).
    Middle stages: hidden -> hidden. Last stage: hidden -> logits (ln_f + lm_head).
    Blocks sit in a ModuleDict keyed by their index in the full model, so names match.
    With a `tp_group` of size > 1 the blocks are tensor-parallel (see the module doc).
    """

    def __init__(self, model: GPT, stage: int, num_stages: int, tp_group=None) -> None:
        super().__init__()
        cfg = model.config
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        self.tp, self.tp_rank = group_size_rank(tp_group)
        validate_tp(cfg, self.tp)
        self.config, self.stage, self.num_stages = cfg, stage, num_stages
        self.layers = split_layers(cfg.n_layer, num_stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        src = model.transformer
        keep: dict[str, nn.Module] = {"h": nn.ModuleDict({str(i): src.h[i] for i in self.layers})}
        if self.is_first:
            keep.update(wte=src.wte, wpe=src.wpe, drop=src.drop)
        if self.is_last:
            keep.update(ln_f=src.ln_f, lm_head=model.lm_head)
        keep = copy.deepcopy(keep)  # one memo: weights tied on one process stay tied
        if self.tp > 1:
            for i, block in keep["h"].items():
                _to_tensor_parallel(block, int(i), tp_group, cfg.n_head, self.tp)
        lm_head = keep.pop("lm_head", None)
        self.transformer = nn.ModuleDict(keep)
        if lm_head is not None:
            self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = _embed(self.transformer, x, self.config.block_size)
        for block in self.transformer.h.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.transformer.ln_f(x))
        return x


def make_stage(model: GPT, stage: int, num_stages: int, tp_group=None) -> GPTStage:
    """An independent copy of `model`'s part for `stage`; `model` is left untouched.

    `tp_group` (a process group of size > 1): the stage's blocks become tensor-parallel
    over it, each rank keeping its slice of the full parameters (size 1 or None: no TP).
    """
    return GPTStage(model, stage, num_stages, tp_group)


# -- the workload rrfp train finds by name (model = "gpt") -------------------------


def check(cfg: GPTConfig, data: DataConfig, num_stages: int, tp: int) -> None:
    """Layout checks that need no process group: ValueError names the mismatch."""
    if cfg.n_layer < num_stages:
        raise ValueError(
            f"model.n_layer={cfg.n_layer} is fewer than the {num_stages} pipeline stages"
        )
    check_fits(data, cfg.vocab_size)
    if data.max_seq_len > cfg.block_size:
        raise ValueError(
            f"data.max_seq_len={data.max_seq_len} is above model.block_size={cfg.block_size}, the "
            f"model's context: raise model.block_size or lower data.max_seq_len"
        )
    if tp > 1:
        validate_tp(cfg, tp)


def build_stage(cfg: GPTConfig, stage: int, num_stages: int, tp_group=None) -> GPTStage:
    """The full model from the current torch seed, cut down to ``stage``."""
    return make_stage(GPT(cfg), stage, num_stages, tp_group=tp_group)


def tied(cfg: GPTConfig, stage: int, num_stages: int) -> dict[str, str]:
    """The tie ``stage`` holds: with ``tie_embeddings``, the token embedding on the first stage and
    the lm head on the last are one parameter (nothing to declare when one stage holds both)."""
    if not cfg.tie_embeddings or num_stages == 1:
        return {}
    if stage == 0:
        return {"embedding": "transformer.wte.weight"}
    return {"embedding": "lm_head.weight"} if stage == num_stages - 1 else {}


def blocks(stage: GPTStage) -> list[nn.Module]:
    """The stage's transformer blocks, each checkpointed alone under activation checkpointing."""
    return list(stage.transformer.h.values())


workload = Workload(
    "gpt",
    GPTConfig,
    DataConfig,
    build_stage,
    loss_fn,
    batches,
    check,
    tied=tied,
    blocks=blocks,
    eval_batches=eval_batches,
    describe_data=describe,
)
