"""A small vision-language model, a ViT encoder feeding a byte-level GPT, and its pipeline split.

The encoder embeds each patch_size x patch_size patch (a SplitLinear on the flat
patch) plus a learned position per patch, runs enc_layers non-causal blocks and
projects to n_embd. The LM (rrfp.models.gpt's blocks) reads [image tokens; text]
causally, with learned positions over the whole sequence.

Split: stage 0 holds the encoder, its projection and the text embeddings, the
last stage ln_f and lm_head. Between stages travels a `Boundary`: the image
tokens' hidden states, the text's, and each sample's number of image tokens
(int64, no gradient). With no images the image part is empty, not None, so the
encoder stays in the graph and gets zero gradients as in the full model (AdamW
would skip a None gradient). A stage runs its blocks on [image; text] joined,
so each weight is used once and the B/W split can move its gradient to W.

`split_blocks` spreads the LM blocks with a per-token cost in units of one block
(12 n_embd^2 multiply-adds): the encoder (patch embedding, enc_layers * 12
enc_embd^2, projection) weighs on stage 0, lm_head (256 n_embd) on the last.
Every stage but the first gets one block, then each further block goes to the
least loaded stage (lowest index on a tie), which minimises the heaviest stage.
The encoder sees only image tokens, so this leans to fewer blocks on stage 0.
The split depends on the config alone.

As in rrfp.models.gpt, a stage is the full model with the other layers removed, so
parameter names stay the full model's. No tensor parallelism: `check` refuses tp > 1.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from rrfp import SplitLinear, Workload, group_size_rank, token_features
from rrfp.models.gpt import GPT, Block, CausalSelfAttention, GPTConfig, loss_fn
from rrfp.models.shapes import (
    IGNORE,
    VLMDataConfig,
    VLMInputs,
    batches,
    check_fits,
    describe,
    patchify,
)

log = logging.getLogger(__name__)

VOCAB = 256  # bytes


@dataclass
class VLMConfig:
    image_size: int = 16
    patch_size: int = 4
    enc_layers: int = 1
    enc_embd: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 256  # longest image tokens + text tokens
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "patch_size",
            "enc_layers",
            "enc_embd",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"VLMConfig.{name} must be positive, got {getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"VLMConfig.patch_size ({self.patch_size}) must divide "
                f"image_size ({self.image_size})"
            )
        for name in ("n_embd", "enc_embd"):
            if getattr(self, name) % self.n_head:
                raise ValueError(
                    f"VLMConfig.{name} ({getattr(self, name)}) must be divisible by "
                    f"n_head ({self.n_head})"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"VLMConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def gpt(self, encoder: bool = False) -> GPTConfig:
        """The GPTConfig of the LM, or of the encoder's blocks."""
        width, layers, block = (
            (self.enc_embd, self.enc_layers, self.patches)
            if encoder
            else (self.n_embd, self.n_layer, self.block_size)
        )
        return GPTConfig(VOCAB, block, layers, self.n_head, width, self.dropout, self.bias)


class Attention(CausalSelfAttention):
    """rrfp.models.gpt's attention without the causal mask: every patch sees every patch."""

    is_causal = False


class EncoderBlock(Block):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.attn = Attention(cfg)


class VisionEncoder(nn.Module):
    """images [b, n, 3, S, S] -> image tokens [b, n * patches, n_embd]; n may be 0."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.config, p = cfg, cfg.patch_size
        self.patch = SplitLinear(3 * p * p, cfg.enc_embd, bias=cfg.bias)
        self.pos = nn.Parameter(torch.zeros(cfg.patches, cfg.enc_embd))
        self.h = nn.ModuleList(EncoderBlock(cfg.gpt(encoder=True)) for _ in range(cfg.enc_layers))
        self.ln = nn.LayerNorm(cfg.enc_embd, bias=cfg.bias)
        self.proj = SplitLinear(cfg.enc_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b, n, g = images.size(0), images.size(1), cfg.image_size // cfg.patch_size
        x = patchify(images, cfg.image_size, cfg.patch_size, self.patch.weight.dtype)
        x = self.patch(x) + self.pos
        for block in self.h:
            x = block(x)
        return self.proj(self.ln(x)).reshape(b, n * g * g, cfg.n_embd)


def _embed(
    vision: VisionEncoder, transformer: nn.ModuleDict, inputs: VLMInputs, block_size: int
) -> torch.Tensor:
    """(images, ids) -> the LM's input sequence [b, n * patches + T, n_embd]."""
    images, ids = inputs
    x = torch.cat([vision(images), transformer.wte(ids)], dim=1)
    if x.size(1) > block_size:
        raise ValueError(
            f"sequence length {x.size(1)} (image and text tokens) exceeds block_size {block_size}"
        )
    return transformer.drop(x + transformer.wpe(torch.arange(x.size(1), device=x.device)))


class Boundary(NamedTuple):
    """What one stage sends the next: the hidden sequence cut into its image and text tokens."""

    image: torch.Tensor  # [b, n * patches, n_embd]; n may be 0
    text: torch.Tensor  # [b, T, n_embd]
    image_tokens: torch.Tensor  # int64 [b]: each sample's number of image tokens


class VLM(nn.Module):
    """The whole model on one process: (images, ids) -> logits [b, n * patches + T, 256]."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision = VisionEncoder(cfg)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg.gpt()) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = SplitLinear(cfg.n_embd, VOCAB, bias=False)
        self.apply(GPT._init_weights)
        nn.init.normal_(self.vision.pos, mean=0.0, std=0.02)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("c_proj.weight"):
                depth = cfg.enc_layers if name.startswith("vision.") else cfg.n_layer
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    def forward(self, inputs: VLMInputs) -> torch.Tensor:
        x = _embed(self.vision, self.transformer, inputs, self.config.block_size)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def split_blocks(cfg: VLMConfig, num_stages: int) -> list[range]:
    """Contiguous LM block ranges per stage: stage 0 may get none, every other stage one or more."""
    if not 1 <= num_stages <= cfg.n_layer + 1:
        raise ValueError(
            f"num_stages must be in [1, n_layer + 1 = {cfg.n_layer + 1}], got {num_stages}"
        )
    e, c, p = cfg.enc_embd, cfg.n_embd, cfg.patch_size  # per-token multiply-adds, in LM blocks:
    encoder = (3 * p * p * e + cfg.enc_layers * 12 * e * e + e * c) / (12 * c * c)
    head = VOCAB / (12 * c)
    counts = [0] + [1] * (num_stages - 1)
    load = [k + encoder * (s == 0) + head * (s == num_stages - 1) for s, k in enumerate(counts)]
    for _ in range(cfg.n_layer - sum(counts)):
        s = min(range(num_stages), key=lambda i: (load[i], i))
        counts[s] += 1
        load[s] += 1
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + k) for a, k in zip(starts, counts)]


class VLMStage(nn.Module):
    """Stage `stage` of `num_stages`, the full model with the other layers removed: (images, ids)
    or a Boundary -> a Boundary, or logits on the last stage. Blocks keep their full-model index."""

    def __init__(self, model: VLM, stage: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        cfg = self.config = model.config
        self.layers = split_blocks(cfg, num_stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        src = model.transformer
        keep: dict[str, nn.Module] = {"h": nn.ModuleDict({str(i): src.h[i] for i in self.layers})}
        if self.is_first:
            keep.update(vision=model.vision, wte=src.wte, wpe=src.wpe, drop=src.drop)
        if self.is_last:
            keep.update(ln_f=src.ln_f, lm_head=model.lm_head)
        keep = copy.deepcopy(keep)
        if self.is_first:
            self.vision = keep.pop("vision")
        if self.is_last:
            self.lm_head = keep.pop("lm_head")
        self.transformer = nn.ModuleDict(keep)

    def forward(self, x: VLMInputs | Boundary) -> Boundary | torch.Tensor:
        if self.is_first:
            n = x.images.size(1) * self.config.patches
            h = _embed(self.vision, self.transformer, x, self.config.block_size)
            image_tokens = torch.full((h.size(0),), n, dtype=torch.int64, device=h.device)
        else:
            image, text, image_tokens = x
            n = image.size(1)  # a shape: reading image_tokens would wait for the device
            h = torch.cat([image, text], dim=1)
        for block in self.transformer.h.values():
            h = block(
                h
            )  # on the whole sequence, so each weight is used once (and its gradient can go to W)
        if self.is_last:
            return self.lm_head(self.transformer.ln_f(h))
        image, text = h.split([n, h.size(1) - n], dim=1)
        return Boundary(image, text, image_tokens)


def make_stage(model: VLM, stage: int, num_stages: int) -> VLMStage:
    """An independent copy of `model`'s part for `stage`; `model` is left untouched."""
    return VLMStage(model, stage, num_stages)


# -- the workload rrfp train finds by name (model = "vlm") -------------------------


def check(cfg: VLMConfig, data: VLMDataConfig, num_stages: int, tp: int) -> None:
    """Layout and model/data agreement checks that need no process group."""
    if tp > 1:
        raise ValueError(
            f"the vlm workload has no tensor parallelism: set parallel.tp = 1 (got tp={tp})"
        )
    if cfg.n_layer < num_stages - 1:
        raise ValueError(
            f"model.n_layer={cfg.n_layer} is too few for {num_stages} pipeline stages: "
            f"stages 1..{num_stages - 1} need at least one LM block each"
        )
    check_fits(cfg, data)


def build_stage(cfg: VLMConfig, stage: int, num_stages: int, tp_group=None) -> VLMStage:
    """The full model from the current torch seed, cut down to ``stage``."""
    if group_size_rank(tp_group)[0] > 1:
        raise ValueError("the vlm workload has no tensor parallelism (tp must be 1)")
    st = make_stage(VLM(cfg), stage, num_stages)
    log.info(
        "vlm stage %d/%d: LM blocks %s%s, %d parameters",
        stage,
        num_stages,
        list(st.layers),
        " + encoder" if st.is_first else "",
        sum(p.numel() for p in st.parameters()),
    )
    return st


def features(batch) -> dict:
    """Tokens and attention over the whole sequence, plus the image patches the encoder embeds."""
    feats = token_features(batch)
    feats["patches"] = float((batch[1] == IGNORE).sum())  # one target is ignored per image token
    return feats


workload = Workload(
    "vlm",
    VLMConfig,
    VLMDataConfig,
    build_stage,
    loss_fn,
    batches,
    check,
    features,
    describe_data=describe,
)
