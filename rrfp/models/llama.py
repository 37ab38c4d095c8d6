"""A Llama/Qwen-family causal LM in nanoGPT's spirit, and its pipeline split.

Pre-norm blocks with RMSNorm, rotary position embeddings (the rotate-half form of HF Llama),
grouped-query attention (``n_kv_head`` key/value heads shared by ``n_head // n_kv_head`` query
heads each), a SwiGLU MLP, optional QK-norm (Qwen3: an RMSNorm over each head's query and key)
and an optional tied input embedding and lm head. Parameter names are HF Llama's without the
``model.`` prefix (``layers.3.self_attn.q_proj.weight``, ``embed_tokens.weight``), so the
architecture checks against transformers' LlamaForCausalLM and Qwen3ForCausalLM.

A stage is built on its own, never as a cut of the whole model: every part (the embedding, each
block, the head) draws its initial values from a generator seeded by (torch's current seed, the
part), so the stage's parameters equal those of the whole model built from the same seed, and a
1B-class model's stage holds only its own layers in memory. ``Llama(cfg)`` is the whole model, the
one-process reference; ``Llama(cfg, stage, num_stages)`` is a stage of it. Blocks sit in a
ModuleDict keyed by their index in the whole model, so names match across the split.

With ``tie_embeddings`` the lm head and the token embedding are one parameter in the whole model;
under pipeline parallelism the first and last stage each hold a copy (drawn from the embedding's
generator, so equal from the start) and ``tied`` declares the pair, which rrfp keeps equal.

A mixture of experts (``moe_experts`` > 0, Qwen3-MoE and DeepSeek-V3 shaped): every block after the
first ``moe_first_dense`` replaces its dense MLP by ``rrfp.nn.moe_layer.MoELayer`` (a top-k router,
``moe_experts`` routed SwiGLU experts computed grouped, optional shared experts), named
``layers.i.mlp.router.gate.weight``, ``layers.i.mlp.experts.w1/w2/w3`` and
``layers.i.mlp.shared_experts.*``; its load balancing (the auxiliary loss, the loss-free bias) is
rrfp.nn.moe_layer's.

Tensor parallelism (``tp_group`` of size > 1, Megatron style): in every block q_proj, k_proj,
v_proj, gate_proj and up_proj become column-parallel and o_proj and down_proj row-parallel, so a
rank holds n_head/tp query heads and n_kv_head/tp key/value heads. Embedding, norms and lm head stay
replicated. QK-norm is refused under TP: its weights would see only the local heads' gradient.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from rrfp import (
    ColumnParallelLinear,
    GroupedExperts,
    MoELayer,
    RowParallelLinear,
    SplitLinear,
    Workload,
    group_size_rank,
    shard_from_full,
)
from rrfp.models.data import DataConfig, batches, check_fits, describe, eval_batches
from rrfp.models.gpt import loss_fn, split_layers

log = logging.getLogger(__name__)

__all__ = ["LlamaConfig", "Llama", "Block", "loss_fn", "split_layers", "workload"]


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    block_size: int = 256  # the longest sequence trained on (rotary needs no table)
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_kv_head: int = 2  # key/value heads; each serves n_head // n_kv_head query heads
    head_dim: int = 0  # 0: n_embd // n_head (Qwen3 sets it apart from the width)
    intermediate_size: int = 0  # SwiGLU hidden width; 0: 4 * n_embd, as a GPT's MLP
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe_experts: int = 0  # routed experts per MoE block; 0: every block's MLP is dense
    moe_top_k: int = 2  # experts each token goes to
    moe_score_func: str = "softmax"  # router scores: softmax, or sigmoid (DeepSeek-V3)
    moe_norm_topk: bool = True  # the chosen experts' gates renormalised to sum to one
    moe_intermediate_size: int = 0  # each routed expert's SwiGLU width; 0: intermediate_size's
    moe_shared_intermediate_size: int = 0  # the shared experts' SwiGLU width; 0: no shared experts
    moe_first_dense: int = 0  # the first blocks that keep a dense MLP (DeepSeek-V3: 3)
    moe_aux_loss_coeff: float = 0.0  # weight of each MoE block's load-balancing loss; 0: none
    moe_bias_update_rate: float = 0.0  # DeepSeek-V3's expert-bias step per optimizer step; 0: none

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "n_kv_head"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self._kind}.{name} must be positive, got {getattr(self, name)}")
        for name in ("head_dim", "intermediate_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self._kind}.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"{self._kind}.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})"
            )
        if not self.head_dim and self.n_embd % self.n_head:
            raise ValueError(
                f"{self._kind}.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}), "
                f"or head_dim set"
            )
        if self.hd % 2:
            raise ValueError(f"{self._kind}: rotary needs an even head_dim, got {self.hd}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self._kind}.{name} must be positive, got {getattr(self, name)}")
        self._check_moe()

    def _check_moe(self) -> None:
        for name in (
            "moe_experts",
            "moe_intermediate_size",
            "moe_shared_intermediate_size",
            "moe_first_dense",
            "moe_aux_loss_coeff",
            "moe_bias_update_rate",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{self._kind}.{name} must be >= 0, got {getattr(self, name)}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(
                f"{self._kind}.moe_top_k must be in [1, moe_experts={self.moe_experts}], "
                f"got {self.moe_top_k}"
            )
        if self.moe_score_func not in ("softmax", "sigmoid"):
            raise ValueError(
                f"{self._kind}.moe_score_func must be softmax or sigmoid, "
                f"got {self.moe_score_func!r}"
            )

    @property
    def _kind(self) -> str:
        return type(self).__name__

    @property
    def hd(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def ffn(self) -> int:
        """Width of the SwiGLU hidden layer."""
        return self.intermediate_size or 4 * self.n_embd

    @property
    def moe_ffn(self) -> int:
        """Width of each routed expert's SwiGLU hidden layer."""
        return self.moe_intermediate_size or self.ffn

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (its index in the whole model) has routed experts."""
        return self.moe_experts > 0 and layer >= self.moe_first_dense

    def block_macs(self) -> int:
        """Multiply-adds of one dense block per token (its linears; attention scores left out)."""
        c, hd = self.n_embd, self.hd
        return 2 * c * self.n_head * hd + 2 * c * self.n_kv_head * hd + 3 * c * self.ffn


# -- seeding: each part of the model from (seed, part) --------------------------------------


def part_generator(seed: int, *part: int) -> torch.Generator:
    """The generator a part of the model draws its initial values from, the same on every stage
    and in the whole model: seeded by the current torch seed and the part's coordinates."""
    state = np.random.SeedSequence([seed, *part]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


EMBED, BLOCK, HEAD = 0, 1, 2  # the parts of the LM (a block's coordinates are (BLOCK, index))


def _normal(like: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device="cpu").normal_(0, std, generator=gen)


@torch.no_grad()
def init_normal(
    module: nn.Module,
    gen: torch.Generator,
    std: float,
    out_std: float,
    out_names: tuple[str, ...] = ("o_proj", "down_proj"),
) -> None:
    """In module order: weights of linears and embeddings ~ N(0, std), those of the residual
    output projections (``out_names``, and routed experts' ``w2``) N(0, out_std), biases zero,
    norms one."""
    for name, m in module.named_modules():
        if isinstance(m, MoELayer):  # its buffers: a meta build leaves them empty
            m.reset_buffers()
        elif isinstance(m, GroupedExperts):
            for w, s in ((m.w1, std), (m.w2, out_std), (m.w3, std)):
                w.copy_(_normal(w, s, gen))
        elif isinstance(m, (nn.RMSNorm, nn.LayerNorm)):
            m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
        elif isinstance(m, (SplitLinear, nn.Linear, nn.Embedding)):
            s = out_std if name.rsplit(".", 1)[-1] in out_names else std
            m.weight.copy_(_normal(m.weight, s, gen))
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()


def materialise(module: nn.Module) -> bool:
    """Give ``module``'s meta-built parameters storage on the current default device (a
    ``torch.device`` context, as the start checks' meta measurement uses); False when that is the
    meta device, where there are no values to draw."""
    device = torch.get_default_device()
    module.to_empty(device=device)
    return device.type != "meta"


# -- the model ------------------------------------------------------------------------------


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x`` [b, heads, T, hd] rotated by its positions 0..T-1 (HF Llama's rotate-half form)."""
    t, hd = x.size(-2), x.size(-1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** -(torch.arange(0, hd, 2, device=x.device, dtype=dtype) / hd)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=dtype), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        c, hd = cfg.n_embd, cfg.hd
        self.hd, self.theta = hd, cfg.rope_theta
        self.q_proj = SplitLinear(c, cfg.n_head * hd, bias=False)
        self.k_proj = SplitLinear(c, cfg.n_kv_head * hd, bias=False)
        self.v_proj = SplitLinear(c, cfg.n_kv_head * hd, bias=False)
        self.o_proj = SplitLinear(cfg.n_head * hd, c, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # under TP the projections hold this rank's heads only
        q, k, v = (
            proj(x).view(b, t, -1, self.hd).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = SplitLinear(cfg.n_embd, cfg.ffn, bias=False)
        self.up_proj = SplitLinear(cfg.n_embd, cfg.ffn, bias=False)
        self.down_proj = SplitLinear(cfg.ffn, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def moe_layer(cfg: LlamaConfig) -> MoELayer:
    """The routed (and shared) experts that replace a block's dense MLP."""
    return MoELayer(
        cfg.n_embd,
        cfg.moe_ffn,
        cfg.moe_experts,
        cfg.moe_top_k,
        score_func=cfg.moe_score_func,
        norm_topk=cfg.moe_norm_topk,
        shared_hidden_dim=cfg.moe_shared_intermediate_size,
        aux_loss_coeff=cfg.moe_aux_loss_coeff,
        bias_update_rate=cfg.moe_bias_update_rate,
    )


class Block(nn.Module):
    """Block ``layer`` of the whole model: attention, then a dense MLP or routed experts."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = moe_layer(cfg) if cfg.is_moe(layer) else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Stage ``stage`` of ``num_stages`` (default: the whole model), built from torch's current
    seed. First stage: ids [b, T] -> hidden [b, T, C]; middle: hidden -> hidden; last: hidden ->
    logits [b, T, vocab]. The whole model: ids -> logits."""

    def __init__(
        self, cfg: LlamaConfig, stage: int = 0, num_stages: int = 1, tp_group=None
    ) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        self.tp, self.tp_rank = group_size_rank(tp_group)
        validate_tp(cfg, self.tp)
        self.config, self.stage, self.num_stages = cfg, stage, num_stages
        self.layer_ids = split_layers(cfg.n_layer, num_stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        seed = torch.initial_seed()
        with torch.device("meta"):  # shapes only: each part gets its values from its generator
            if self.is_first:
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in self.layer_ids})
            if self.is_last:
                self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
                self.lm_head = SplitLinear(cfg.n_embd, cfg.vocab_size, bias=False)
        materialised = materialise(self)  # (which would untie a tie made on meta)
        if self.is_last and cfg.tie_embeddings and self.is_first:
            self.lm_head.weight = self.embed_tokens.weight
        if materialised:
            self._init(cfg, seed)
        if self.tp > 1:
            for i, block in self.layers.items():
                to_tensor_parallel(block, f"layers.{i}", tp_group)

    def _init(self, cfg: LlamaConfig, seed: int) -> None:
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layer) ** 0.5
        if self.is_first:
            init_normal(self.embed_tokens, part_generator(seed, EMBED), std, out_std)
        for i, block in self.layers.items():
            init_normal(block, part_generator(seed, BLOCK, int(i)), std, out_std)
        if self.is_last:
            init_normal(self.norm, part_generator(seed, HEAD), std, out_std)
            if not (cfg.tie_embeddings and self.is_first):  # a tied copy draws the embedding's
                part = EMBED if cfg.tie_embeddings else HEAD
                init_normal(self.lm_head, part_generator(seed, part), std, out_std)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.size(1) > self.config.block_size:
                raise ValueError(
                    f"sequence length {x.size(1)} exceeds block_size {self.config.block_size}"
                )
            x = self.embed_tokens(x)
        for block in self.layers.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


# -- tensor parallelism ---------------------------------------------------------------------

# block-relative module path -> TP layer class
_TP_PLAN: dict[str, type] = {
    "self_attn.q_proj": ColumnParallelLinear,
    "self_attn.k_proj": ColumnParallelLinear,
    "self_attn.v_proj": ColumnParallelLinear,
    "self_attn.o_proj": RowParallelLinear,
    "mlp.gate_proj": ColumnParallelLinear,
    "mlp.up_proj": ColumnParallelLinear,
    "mlp.down_proj": RowParallelLinear,
}
_TP_NAME = re.compile(
    r"(?:^|\.)layers\.\d+\.(" + "|".join(re.escape(k) for k in _TP_PLAN) + r")\.(weight|bias)$"
)


def validate_tp(cfg: LlamaConfig, tp: int) -> None:
    """Raise ValueError unless the model can be split over ``tp`` tensor-parallel ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    for name, size in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head), ("ffn", cfg.ffn)):
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name}={size}")
    if cfg.moe_experts:
        raise ValueError(
            f"a mixture of experts (model.moe_experts = {cfg.moe_experts}) has no tensor "
            f"parallelism in rrfp: set tp = 1 (got tp={tp})"
        )
    if cfg.qk_norm:
        raise ValueError(
            f"qk_norm has no tensor parallelism (its weights would see only a rank's heads): "
            f"set tp = 1 or qk_norm = false (got tp={tp})"
        )


def tp_shard_spec(name: str) -> tuple[int, int] | None:
    """(sharded dim, chunks) of a whole-model parameter name under TP; None if replicated."""
    m = _TP_NAME.search(name)
    if m is None:
        return None
    dim = _TP_PLAN[m.group(1)].shard_dims[m.group(2)]
    return None if dim is None else (dim, 1)


def full_grad_slice(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The part of whole-model tensor ``name`` (a parameter or its gradient) that TP rank
    ``tp_rank`` of ``tp`` holds: a slice for sharded parameters, the whole for replicated."""
    spec = tp_shard_spec(name)
    if spec is None or tp == 1:
        return full
    dim, chunks = spec
    return shard_from_full(full, dim, tp_rank, tp, chunks)


def to_tensor_parallel(block: nn.Module, prefix: str, group) -> None:
    """Replace ``block``'s projections by their TP shards over ``group`` (values kept)."""
    for path, cls in _TP_PLAN.items():
        parent_name, attr = path.split(".")
        parent = getattr(block, parent_name)
        setattr(parent, attr, cls.from_full(getattr(parent, attr), group, name=f"{prefix}.{path}"))


# -- the workload rrfp train finds by name (model = "llama") ---------------------------------


def check(cfg: LlamaConfig, data: DataConfig, num_stages: int, tp: int) -> None:
    """Layout and model/data agreement checks that need no process group."""
    if cfg.n_layer < num_stages:
        raise ValueError(
            f"model.n_layer={cfg.n_layer} is fewer than the {num_stages} pipeline stages"
        )
    check_fits(data, cfg.vocab_size)
    if data.max_seq_len > cfg.block_size:
        raise ValueError(
            f"data.max_seq_len={data.max_seq_len} is above model.block_size={cfg.block_size}: "
            f"raise model.block_size or lower data.max_seq_len"
        )
    validate_tp(cfg, tp)


def build_stage(cfg: LlamaConfig, stage: int, num_stages: int, tp_group=None) -> Llama:
    """Stage ``stage`` alone, its parameters those of the whole model from the current seed."""
    st = Llama(cfg, stage, num_stages, tp_group)
    log.info(
        "llama stage %d/%d: layers %s, %d parameters",
        stage,
        num_stages,
        list(st.layer_ids),
        sum(p.numel() for p in st.parameters()),
    )
    return st


def tied(cfg: LlamaConfig, stage: int, num_stages: int) -> dict[str, str]:
    """With ``tie_embeddings``: the token embedding on the first stage and the lm head on the last
    are one parameter (nothing to declare when one stage holds both)."""
    if not cfg.tie_embeddings or num_stages == 1:
        return {}
    if stage == 0:
        return {"embedding": "embed_tokens.weight"}
    return {"embedding": "lm_head.weight"} if stage == num_stages - 1 else {}


def stage_blocks(module: nn.Module) -> list[nn.Module]:
    """A stage's transformer blocks, each one activation-checkpointing region."""
    return module.blocks()


workload = Workload(
    "llama",
    LlamaConfig,
    DataConfig,
    build_stage,
    loss_fn,
    batches,
    check,
    tied=tied,
    blocks=stage_blocks,
    eval_batches=eval_batches,
    describe_data=describe,
)
