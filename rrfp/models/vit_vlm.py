"""The paper's multimodal shape, small: a ViT encoder feeding the Llama-family LM
(rrfp.models.llama) through an MLP projector, on procedural images with 0..max_images images per
sample (rrfp.models.shapes), and its pipeline split.

The encoder embeds each patch_size x patch_size patch (a linear on the flat patch) plus a learned
position per patch and runs enc_layers pre-norm ViT blocks (LayerNorm, bidirectional attention,
GELU MLP). A final LayerNorm and the projector (linear, GELU, linear: LLaVA's) map each patch into
the LM's width; the LM reads [image tokens; text] causally, rotary positions over the whole
sequence.

Split: the model is a chain of parts, each with a cost per image token in multiply-adds (patch
embedding; each ViT block; the projector with the text embedding; each LM block; the head), and
the stages take contiguous runs of it that minimise the heaviest stage. So the encoder's blocks
spread over the first stages when the encoder outweighs a stage's share, and a stage that holds
part of the encoder holds fewer LM blocks. Text tokens add LM work that this split leaves out:
it depends on the config alone. Between two stages inside the encoder travels an `Encoding` (the
patches' hidden states [b, n * patches, enc_embd] and the text ids, int64, no gradient) and after
the projector the LM's hidden sequence [b, n * patches + T, n_embd]. With no images the patches are
an empty tensor, so the encoder stays in the graph and gets zero gradients as in the whole model.

Every part draws its initial values from a generator seeded by (torch's current seed, the part), as
in rrfp.models.llama, so a stage is built alone and equals that part of the whole model
``ViTVLM(cfg)``. No tensor parallelism: ``check`` refuses tp > 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from rrfp import SplitLinear, Workload, group_size_rank
from rrfp.models.gpt import loss_fn
from rrfp.models.llama import (
    BLOCK,
    EMBED,
    HEAD,
    Block,
    LlamaConfig,
    init_normal,
    materialise,
    part_generator,
)
from rrfp.models.shapes import VLMDataConfig, VLMInputs, batches, check_fits, describe, patchify
from rrfp.models.vlm import features

log = logging.getLogger(__name__)

__all__ = ["ViTVLMConfig", "ViTVLM", "Encoding", "split_parts", "workload"]

# part kinds, in chain order (a part is (kind, index))
PATCH, VIT, PROJ, LM, HEAD_PART = "patch", "vit", "proj", "lm", "head"
_SEEDS = {PATCH: 10, VIT: 11, PROJ: 12}  # generator coordinates of the vision parts


@dataclass
class ViTVLMConfig(LlamaConfig):
    """The LM's fields (rrfp.models.llama) plus the encoder's."""

    block_size: int = 640  # longest image tokens + text tokens
    image_size: int = 16
    patch_size: int = 4
    enc_layers: int = 2
    enc_embd: int = 32
    enc_head: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("image_size", "patch_size", "enc_layers", "enc_embd", "enc_head"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ViTVLMConfig.{name} must be positive, got {getattr(self, name)}")
        if self.moe_experts:
            raise ValueError(
                f"ViTVLMConfig.moe_experts = {self.moe_experts}: vit_vlm's LM is dense (the "
                f"mixture of experts is llama's); leave moe_experts at 0"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTVLMConfig.patch_size ({self.patch_size}) must divide "
                f"image_size ({self.image_size})"
            )
        if self.enc_embd % self.enc_head:
            raise ValueError(
                f"ViTVLMConfig.enc_embd ({self.enc_embd}) must be divisible by "
                f"enc_head ({self.enc_head})"
            )

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViTBlock(nn.Module):
    """Pre-norm ViT block: every patch attends to every patch of its image."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = SplitLinear(width, 3 * width)
        self.proj = SplitLinear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc1 = SplitLinear(width, 4 * width)
        self.fc2 = SplitLinear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, c // self.heads)  # b may be 0
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class Encoding(NamedTuple):
    """What a stage inside the encoder sends the next."""

    patches: torch.Tensor  # [b, n * patches, enc_embd]; n may be 0
    ids: torch.Tensor  # int64 [b, T], embedded by the stage that holds the projector


def parts(cfg: ViTVLMConfig) -> list[tuple[str, int, int]]:
    """The model's chain of parts, (kind, index, multiply-adds per image token)."""
    e, c, p = cfg.enc_embd, cfg.n_embd, cfg.patch_size
    return [
        (PATCH, 0, 3 * p * p * e),
        *((VIT, i, 12 * e * e) for i in range(cfg.enc_layers)),
        (PROJ, 0, e * c + c * c),
        *((LM, i, cfg.block_macs()) for i in range(cfg.n_layer)),
        (HEAD_PART, 0, c * cfg.vocab_size),
    ]


def split_parts(cfg: ViTVLMConfig, num_stages: int) -> list[list[tuple[str, int]]]:
    """Contiguous runs of the chain of parts, one per stage, that minimise the heaviest stage's
    cost (the later cut on a tie, so earlier stages lean light)."""
    chain = parts(cfg)
    n = len(chain)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be in [1, {n}] (the model's parts), got {num_stages}")
    prefix = [0]
    for *_, cost in chain:
        prefix.append(prefix[-1] + cost)
    inf = prefix[-1] + 1
    # best[s][j]: the least heaviest stage over s stages holding parts [0, j); cut[s][j]: its start
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                load = max(best[s - 1][i], prefix[j] - prefix[i])
                if load <= best[s][j]:
                    best[s][j], cut[s][j] = load, i
    runs, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        runs.append([(kind, index) for kind, index, _ in chain[i:j]])
        j = i
    return runs[::-1]


class ViTVLM(nn.Module):
    """Stage ``stage`` of ``num_stages`` (default: the whole model), built from torch's current
    seed: (images, ids), an Encoding or the hidden sequence -> an Encoding, the hidden sequence, or
    logits [b, n * patches + T, vocab] on the last stage."""

    def __init__(self, cfg: ViTVLMConfig, stage: int = 0, num_stages: int = 1) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        self.config, self.stage, self.num_stages = cfg, stage, num_stages
        self.parts = split_parts(cfg, num_stages)[stage]
        kinds = {kind for kind, _ in self.parts}
        self.is_first, self.is_last = stage == 0, HEAD_PART in kinds
        self.has_proj = PROJ in kinds
        self.in_encoder = bool(kinds & {PATCH, VIT, PROJ})  # its input is not the LM's sequence
        e, c = cfg.enc_embd, cfg.n_embd
        seed = torch.initial_seed()
        with torch.device("meta"):
            if self.is_first:
                self.patch_embed = SplitLinear(3 * cfg.patch_size**2, e)
                self.pos_embed = nn.Parameter(torch.empty(cfg.patches, e))
            self.vision_blocks = nn.ModuleDict(
                {str(i): ViTBlock(e, cfg.enc_head) for kind, i in self.parts if kind == VIT}
            )
            if self.has_proj:
                self.vision_norm = nn.LayerNorm(e)
                self.projector = nn.Sequential(SplitLinear(e, c), nn.GELU(), SplitLinear(c, c))
                self.embed_tokens = nn.Embedding(cfg.vocab_size, c)
            self.layers = nn.ModuleDict(
                {str(i): Block(cfg) for kind, i in self.parts if kind == LM}
            )
            if self.is_last:
                self.norm = nn.RMSNorm(c, eps=cfg.norm_eps)
                self.lm_head = SplitLinear(c, cfg.vocab_size, bias=False)
        materialised = materialise(self)  # (which would untie a tie made on meta)
        if self.is_last and cfg.tie_embeddings and self.has_proj:
            self.lm_head.weight = self.embed_tokens.weight
        if materialised:
            self._init(cfg, seed)

    @torch.no_grad()
    def _init(self, cfg: ViTVLMConfig, seed: int) -> None:
        std = cfg.init_std
        vit_out, lm_out = std / (2 * cfg.enc_layers) ** 0.5, std / (2 * cfg.n_layer) ** 0.5
        if self.is_first:
            gen = part_generator(seed, _SEEDS[PATCH])
            init_normal(self.patch_embed, gen, std, std)
            pos = torch.empty(self.pos_embed.shape, dtype=self.pos_embed.dtype, device="cpu")
            self.pos_embed.copy_(pos.normal_(0, std, generator=gen))
        for i, block in self.vision_blocks.items():
            gen = part_generator(seed, _SEEDS[VIT], int(i))
            init_normal(block, gen, std, vit_out, out_names=("proj", "fc2"))
        if self.has_proj:
            gen = part_generator(seed, _SEEDS[PROJ])
            init_normal(self.vision_norm, gen, std, std)
            init_normal(self.projector, gen, std, std)
            init_normal(self.embed_tokens, part_generator(seed, EMBED), std, std)
        for i, block in self.layers.items():
            init_normal(block, part_generator(seed, BLOCK, int(i)), std, lm_out)
        if self.is_last:
            init_normal(self.norm, part_generator(seed, HEAD), std, std)
            if not (cfg.tie_embeddings and self.has_proj):  # a tied copy draws the embedding's
                part = EMBED if cfg.tie_embeddings else HEAD
                init_normal(self.lm_head, part_generator(seed, part), std, std)

    def blocks(self) -> list[nn.Module]:
        return [*self.vision_blocks.values(), *self.layers.values()]

    def _patchify(self, images: torch.Tensor) -> torch.Tensor:
        """[b, n, 3, S, S] -> [b * n, patches, 3 * p * p]."""
        cfg = self.config
        return patchify(images, cfg.image_size, cfg.patch_size, self.patch_embed.weight.dtype)

    def forward(self, x: VLMInputs | Encoding | torch.Tensor) -> Encoding | torch.Tensor:
        cfg = self.config
        if self.in_encoder:
            # sizes are spelled out: with no images every tensor here has 0 elements
            if self.is_first:
                images, ids = x
                v = self.patch_embed(self._patchify(images)) + self.pos_embed
            else:
                v, ids = x
                v = v.reshape(v.size(0) * v.size(1) // cfg.patches, cfg.patches, cfg.enc_embd)
            b, image_tokens = ids.size(0), v.size(0) * cfg.patches // ids.size(0)
            for block in self.vision_blocks.values():
                v = block(v)
            if not self.has_proj:
                return Encoding(v.reshape(b, image_tokens, cfg.enc_embd), ids)
            image = self.projector(self.vision_norm(v)).reshape(b, image_tokens, cfg.n_embd)
            x = torch.cat([image, self.embed_tokens(ids)], dim=1)
            if x.size(1) > cfg.block_size:
                raise ValueError(
                    f"sequence length {x.size(1)} (image and text tokens) exceeds "
                    f"block_size {cfg.block_size}"
                )
        for block in self.layers.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


# -- the workload rrfp train finds by name (model = "vit_vlm") ------------------------------


def check(cfg: ViTVLMConfig, data: VLMDataConfig, num_stages: int, tp: int) -> None:
    """Layout and model/data agreement checks that need no process group."""
    if tp > 1:
        raise ValueError(
            f"the vit_vlm workload has no tensor parallelism: set parallel.tp = 1 (got tp={tp})"
        )
    if num_stages > len(parts(cfg)):
        raise ValueError(
            f"{num_stages} pipeline stages exceed the model's {len(parts(cfg))} parts "
            f"(patch embedding, {cfg.enc_layers} ViT blocks, projector, {cfg.n_layer} LM blocks, "
            f"head): raise model.n_layer or model.enc_layers"
        )
    if cfg.vocab_size < 256:
        raise ValueError(
            f"model.vocab_size={cfg.vocab_size} is below the data's 256 byte tokens: set it >= 256"
        )
    check_fits(cfg, data)


def build_stage(cfg: ViTVLMConfig, stage: int, num_stages: int, tp_group=None) -> ViTVLM:
    """Stage ``stage`` alone, its parameters those of the whole model from the current seed."""
    if group_size_rank(tp_group)[0] > 1:
        raise ValueError("the vit_vlm workload has no tensor parallelism (tp must be 1)")
    st = ViTVLM(cfg, stage, num_stages)
    log.info(
        "vit_vlm stage %d/%d: %s, %d parameters",
        stage,
        num_stages,
        " ".join(f"{kind}{index}" for kind, index in st.parts),
        sum(p.numel() for p in st.parameters()),
    )
    return st


def tied(cfg: ViTVLMConfig, stage: int, num_stages: int) -> dict[str, str]:
    """With ``tie_embeddings``: the text embedding (on the projector's stage) and the lm head (on
    the last) are one parameter; nothing to declare when one stage holds both."""
    if not cfg.tie_embeddings:
        return {}
    runs = split_parts(cfg, num_stages)
    embed = next(s for s, run in enumerate(runs) if (PROJ, 0) in run)
    if embed == num_stages - 1:
        return {}
    if stage == embed:
        return {"embedding": "embed_tokens.weight"}
    return {"embedding": "lm_head.weight"} if stage == num_stages - 1 else {}


def stage_blocks(module: nn.Module) -> list[nn.Module]:
    """A stage's ViT and LM blocks, each one activation-checkpointing region."""
    return module.blocks()


workload = Workload(
    "vit_vlm",
    ViTVLMConfig,
    VLMDataConfig,
    build_stage,
    loss_fn,
    batches,
    check,
    features,
    tied=tied,
    blocks=stage_blocks,
    describe_data=describe,
)
